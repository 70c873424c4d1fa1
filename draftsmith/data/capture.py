"""Hidden-state capture: what a head kind needs from the frozen target, in a sharded store.

The head kind says what it needs (`target.features.FeatureNeeds`, from its registry spec): the
hidden states entering some layers (EAGLE-3), or the final normed hidden state (EAGLE-1/2, Medusa,
MTP). Per sample the store keeps input_ids, loss_mask and the features up to the last position that
training reads (layout: `records.py`). With `capture.recompute` (the default) it keeps only the
features the target cannot rebuild cheaply: for EAGLE-3 the mid and high ones. The trainer rebuilds
the low feature from the embedding (the first ids[0] target layers) and the teacher from the high
feature (the last N - ids[-1] layers), exactly as capture would have computed them
(`FeatureCompleter`). Without it, the store also keeps the low feature and the final normed hidden
state at teacher positions (the position before each loss-masked token). Logits are always rebuilt
with the target's lm_head at train time. Feature tensors are compressed losslessly per sample
(`capture.compression: zstd`: blosc2 byte-shuffle + zstd), so a sample can still be read on its own.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from draftsmith import artifacts
from draftsmith.data import images
from draftsmith.data.records import COMPRESSED, STORE_DTYPES, concat_shard, encode, encode_record, needed_length, sample_record
from draftsmith.recipe import Recipe
from draftsmith.targets.features import CONVENTION, FeatureExtractor, FeatureNeeds


def layer_ids_for(recipe: Recipe, num_layers: int, needs: FeatureNeeds) -> list[int]:
    """The layer ids to capture for this recipe's head kind (none for heads fed the final hidden)."""
    if needs.feature == "final":
        if recipe.capture.layer_ids:
            raise ValueError(f"capture.layer_ids={recipe.capture.layer_ids}: head.kind={recipe.head.kind} is fed the "
                             "final normed hidden state; layer ids apply to eagle3 only (remove the key)")
        return []
    ids = recipe.capture.layer_ids if recipe.capture.layer_ids is not None else needs.default_layer_ids(num_layers)
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise ValueError(f"capture.layer_ids={ids}: ids must be in [0, {num_layers - 1}] for this target ({bad} are not)")
    return list(ids)


def batch_records(extractor: FeatureExtractor, rows: dict, dtype: str, tokenizer=None) -> tuple[list[dict], int]:
    """Run one padded batch of data rows through the target; return (one record per row, real
    tokens). The one code path shared by offline capture, online training and the benchmark. Rows with
    images (an image-text target's data) run with their pixel inputs from the target's processor, which
    `tokenizer` carries (`load_tokenizer`)."""
    ids, attn = pad_batch(rows["input_ids"])
    device = next(extractor.model.parameters()).device
    pixels = images.pixel_inputs(tokenizer, rows["images"], f"data rows {rows['id'][:3]}", ids,
                                 extractor.model) if "images" in rows else {}
    aux, final = extractor(ids.to(device), attn.to(device), **pixels)
    aux, final = (None if t is None else t.cpu() for t in (aux, final))  # records are host tensors (collate pads on host)
    if not extractor.layer_ids:  # heads fed the final hidden: it is their feature, and the teacher where a loss is
        aux, final = final, None
    records = []
    for r, mask in enumerate(rows["loss_mask"]):
        n = len(mask)
        records.append(sample_record(ids[r, :n], torch.tensor(mask), None if aux is None else aux[r, :n],
                                     None if final is None else final[r, :n], dtype, needed_length(mask)))
    return records, int(attn.sum())


class ShardWriter:
    """Buffers samples and writes a shard atomically when the buffer passes `shard_bytes`.
    Each finished shard is recorded in this rank's progress file after its rename. Compressed
    tensors are named in the shard's metadata (`encoded`: key -> [dtype, width])."""

    def __init__(self, store: Path, rank: int, shard_bytes: int, first_index: int, compression: str = "none"):
        self.store, self.rank, self.shard_bytes, self.compression = store, rank, shard_bytes, compression
        self.records, self.indices, self.num_bytes = [], [], 0
        self.next_shard = first_index
        self.layout: dict[str, list] = {}
        self.progress = store / f"progress-r{rank}.jsonl"

    def add(self, index: int, record: dict) -> None:
        record = encode_record(record, self.compression, self.layout)
        self.records.append(record)
        self.indices.append(index)
        self.num_bytes += sum(t.numel() * t.element_size() for t in record.values() if t is not None)
        if self.num_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.records:
            return
        name = f"shard-r{self.rank:03d}-{self.next_shard:05d}.safetensors"
        path = self.store / name
        metadata = {"compression": self.compression, "encoded": json.dumps(self.layout)}
        with artifacts.atomic_path(path) as tmp:
            save_file(concat_shard(self.records, self.indices), str(tmp), metadata=metadata)
            entry = {"file": name, "sha256": artifacts.sha256_file(tmp), "bytes": tmp.stat().st_size,
                     "samples": self.indices, "num_tokens": int(sum(r["input_ids"].numel() for r in self.records))}
        with open(self.progress, "a") as handle:
            handle.write(json.dumps(entry) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.next_shard += 1
        self.records, self.indices, self.num_bytes = [], [], 0


def read_progress(store: Path) -> list[dict]:
    """Every shard any rank finished; a torn last line (kill mid-write) is ignored."""
    entries = []
    for path in sorted(store.glob("progress-r*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if (store / entry["file"]).exists():
                entries.append(entry)
    return entries


def remove_orphans(store: Path, entries: list[dict]) -> None:
    """Shards on disk that no progress line vouches for are incomplete work: delete them."""
    known = {e["file"] for e in entries}
    for path in store.glob("shard-*.safetensors"):
        if path.name not in known:
            path.unlink()
    for path in store.glob(".shard-*"):
        path.unlink()


# ---------------------------------------------------------------- the stage


@dataclass
class CaptureSpec:
    """Everything that makes two stores interchangeable; the reader checks it against the recipe."""
    target_id: str
    target_fingerprint: str
    head_kind: str
    layer_ids: list[int]
    dtype: str
    hidden_size: int
    data_hash: str
    recompute: bool
    stored_layer_ids: list[int]
    compression: str
    feature: str = "layers"  # "layers": the hidden states entering layer_ids; "final": the final normed hidden state

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def capture_dir(recipe: Recipe) -> Path:
    return recipe.run_dir / "capture"


def make_spec(recipe: Recipe, num_layers: int, hidden_size: int, data_manifest: dict, needs: FeatureNeeds,
              with_images: bool = False) -> CaptureSpec:
    from draftsmith.targets.loading import target_fingerprint
    ids = layer_ids_for(recipe, num_layers, needs)
    # heads without several features store them all; so does image data (rebuilding the low feature at train time
    # would need the images again: the stored features already hold what the vision tower gave the language model)
    recompute = recipe.capture.recompute and len(ids) >= 2 and not with_images
    if recompute and ids != sorted(ids):
        raise ValueError(f"capture.recompute needs ascending capture.layer_ids (got {ids}): the lowest is rebuilt "
                         "from the embedding and the teacher from the highest; sort them or set capture.recompute: false")
    return CaptureSpec(recipe.target.model, target_fingerprint(recipe.target.model), recipe.head.kind, ids,
                       recipe.capture.dtype, hidden_size, data_manifest["inputs_hash"], recompute,
                       ids[1:] if recompute else ids, recipe.capture.compression,
                       needs.feature)


def projected_bytes(dataset, spec: CaptureSpec, feature_ratio: float = 1.0) -> dict:
    """Size of the store before anything is written, next to SpecForge's 4·H bf16 layout: exact
    without compression; with it, the feature bytes times `feature_ratio` (measured on a sample)."""
    final = spec.feature == "final"  # the final hidden is the feature (and the teacher where a loss is)
    width = spec.hidden_size if final else len(spec.stored_layer_ids) * spec.hidden_size
    aux_bytes = 1 if spec.dtype == "fp8" else STORE_DTYPES[spec.dtype].itemsize
    teacher_bytes = (2 if spec.dtype == "fp8" else aux_bytes) * (not spec.recompute and not final)
    features = other = tokens = 0
    for mask in dataset["loss_mask"]:
        keep, teachers = needed_length(mask), sum(mask[1:])
        features += keep * width * aux_bytes + teachers * spec.hidden_size * teacher_bytes
        other += len(mask) * 5 + teachers * 4 + keep * 4 * (spec.dtype == "fp8" and width > 0)  # fp8: one fp32 scale per row
        tokens += len(mask)
    total = other + features * feature_ratio
    specforge = tokens * 4 * spec.hidden_size * 2
    return {"bytes": int(total), "num_tokens": tokens, "bytes_per_token": total / max(tokens, 1),
            "uncompressed_bytes": other + features, "compression_ratio": feature_ratio,
            "specforge_bytes": specforge, "ratio_vs_specforge": total / max(specforge, 1)}


def feature_ratio(extractor, dataset, spec: CaptureSpec, num_samples: int = 32, tokenizer=None) -> float:
    """Compressed / raw feature bytes over evenly spaced samples (nothing written)."""
    if spec.compression == "none":
        return 1.0
    step = max(1, len(dataset) // num_samples)
    records, _ = batch_records(extractor, dataset[list(range(0, len(dataset), step))[:num_samples]], spec.dtype, tokenizer)
    raw = packed = 0
    for record in records:
        for key in COMPRESSED:
            if record.get(key) is not None:
                raw += record[key].numel() * record[key].element_size()
                packed += encode(record[key]).numel()
    return packed / max(raw, 1)


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Length-sorted batches of sample indices under a padded-token budget (padding stays small).
    A pure function of the lengths and the budget."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    plan, batch, longest = [], [], 0
    for i in order:
        if batch and max(longest, lengths[i]) * (len(batch) + 1) > batch_tokens:
            plan.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, lengths[i])
    return plan + [batch] if batch else plan


def pad_batch(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
    return ids, mask


def run_capture(recipe: Recipe, needs: FeatureNeeds, dry_run: bool = False) -> dict:
    """Capture this replica's slice of the data; rank 0 merges the manifest. With `target.parallel`
    the target is sharded over the ranks of a replica (targets/parallel.py): they run each batch
    together and the first of them writes; replicas split the batches (replica::dp).
    `needs`: what the recipe's head kind reads from the target (its registry spec's `features`)."""
    from draftsmith.data.prepare import load_train
    from draftsmith.targets import parallel
    from draftsmith.targets.loading import load_target, load_tokenizer
    layout = parallel.layout_for(recipe, "capture")
    parallel.init_process_group()  # gloo across CPU processes when there is no GPU
    device = parallel.rank_device(torch.device("cpu"))
    dataset, data_manifest = load_train(recipe)
    model = load_target(recipe, device, layout, "capture")
    cfg = model.config.get_text_config()
    with_images = "images" in dataset.column_names
    tokenizer = load_tokenizer(recipe) if with_images else None  # it carries the target's processor
    spec = make_spec(recipe, cfg.num_hidden_layers, cfg.hidden_size, data_manifest, needs, with_images)
    extractor = FeatureExtractor(model, spec.stored_layer_ids, stop_after_features=spec.recompute,
                                 chunk_tokens=recipe.capture.chunk_tokens)
    if dry_run:
        return projected_bytes(dataset, spec, feature_ratio(extractor, dataset, spec, tokenizer=tokenizer))
    store = capture_dir(recipe)
    if layout.rank == 0:
        store.mkdir(parents=True, exist_ok=True)
        _reset_if_other_spec(store, spec)
        remove_orphans(store, read_progress(store))
    parallel.barrier()
    entries = read_progress(store)
    done = {i for e in entries for i in e["samples"]}
    # the batches are planned once from the data and the recipe (never from what is done, nor from the
    # number of processes), so a resumed capture computes every sample in the very same padded batch
    # and writes exactly the bytes of an uninterrupted one
    plan = plan_batches([len(ids) for ids in dataset["input_ids"]], recipe.capture.batch_tokens)
    mine = [b for j, b in enumerate(plan) if j % layout.dp == layout.replica and not done.issuperset(b)]
    writer = ShardWriter(store, layout.replica, int(recipe.capture.shard_size_mb * 2**20),
                         first_index=1 + max((int(e["file"][11:16]) for e in entries
                                             if e["file"].startswith(f"shard-r{layout.replica:03d}")), default=-1),
                         compression=spec.compression) if layout.is_writer else None
    total = sum(len(dataset[i]["input_ids"]) for batch in mine for i in batch)
    bar = tqdm(total=total, desc="capture", unit="tok", unit_scale=True, mininterval=2.0, disable=layout.rank != 0)
    for batch in mine:
        records, num_tokens = batch_records(extractor, dataset[batch], spec.dtype, tokenizer)
        for index, record in zip(batch, records):
            if writer is not None and index not in done:  # a batch cut by a kill: its finished samples are stored
                writer.add(index, record)
        bar.update(num_tokens)
    if writer is not None:
        writer.flush()
    bar.close()
    parallel.barrier()
    processor = getattr(tokenizer, "draftsmith_processor", None)
    manifest = finalize(recipe, store, spec, len(dataset), processor) if layout.rank == 0 else {}
    parallel.barrier()
    return manifest


def _reset_if_other_spec(store: Path, spec: CaptureSpec) -> None:
    """A store begun for another target/layers/dtype/data cannot be resumed: start it over."""
    spec_path = store / "spec.json"
    if spec_path.exists() and artifacts.read_json(spec_path) != spec.as_dict():
        for path in list(store.glob("shard-*")) + list(store.glob("progress-*")) + [store / artifacts.MANIFEST]:
            if path.exists():
                path.unlink()
    artifacts.write_json(spec_path, spec.as_dict())


def finalize(recipe: Recipe, store: Path, spec: CaptureSpec, num_samples: int, processor=None) -> dict:
    """Merge every rank's progress into the manifest, after checking each sample is there once. Image data records
    the image processor's settings (sizes, min/max pixels) that shaped its image tokens."""
    entries = read_progress(store)
    seen = sorted(i for e in entries for i in e["samples"])
    if seen != list(range(num_samples)):
        raise artifacts.ArtifactError(f"{store}: capture incomplete or duplicated ({len(seen)} records for {num_samples} samples)")
    num_bytes = sum(e["bytes"] for e in entries)
    num_tokens = sum(e["num_tokens"] for e in entries)
    return artifacts.write_manifest(
        store, "capture", capture_inputs_hash(recipe), **spec.as_dict(), convention=CONVENTION,
        num_samples=num_samples, num_tokens=num_tokens, num_bytes=num_bytes,
        bytes_per_token=num_bytes / max(num_tokens, 1),
        specforge_bytes_per_token=4 * spec.hidden_size * 2,
        rebuilt_at_train_time={"low_feature": f"target layers [0, {spec.layer_ids[0]}) from the embedding",
                               "teacher": f"target layers [{spec.layer_ids[-1]}, N) and the final norm from the high feature"}
        if spec.recompute else {},
        shards=[{k: e[k] for k in ("file", "sha256", "bytes", "num_tokens")} | {"num_samples": len(e["samples"])} for e in entries],
        **({"image_processor": json.loads(processor.image_processor.to_json_string())} if processor is not None else {}))


def capture_inputs_hash(recipe: Recipe) -> str:
    return recipe.section_hash("target", "data", "capture") + "-" + recipe.head.kind


def verify(store: Path) -> list[str]:
    """Checksum every shard against the manifest; return the problems found (empty = sound)."""
    manifest = artifacts.read_manifest(store, "capture")
    problems = []
    for shard in manifest["shards"]:
        path = store / shard["file"]
        if not path.exists():
            problems.append(f"{path}: missing")
        elif artifacts.sha256_file(path) != shard["sha256"]:
            problems.append(f"{path}: sha256 mismatch (corrupt shard)")
    return problems
