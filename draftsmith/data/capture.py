"""Hidden-state capture: what a head kind needs from the frozen target, in a sharded store.

Layer ids use the *input-to-layer* convention: id k is the hidden state entering decoder layer k,
i.e. Hugging Face `hidden_states[k]` (0 = embeddings). This is vLLM's and EAGLE's convention;
SGLang's config ids are ours minus one (its loader adds one), SpecForge's `output of layer` ids too.

Per sample the store keeps input_ids, loss_mask and the features up to the last position that
training reads. With `capture.recompute` (the default) it keeps only the features the target cannot
rebuild cheaply: for EAGLE-3 the mid and high ones. The trainer rebuilds the low feature from the
embedding (the first ids[0] target layers) and the teacher from the high feature (the last
N - ids[-1] layers), exactly as capture would have computed them (`FeatureCompleter`). Without it,
the store also keeps the low feature and the final normed hidden state at teacher positions (the
position before each loss-masked token). Logits are always rebuilt with the target's lm_head at
train time. Feature tensors are compressed losslessly per sample (`capture.compression: zstd`:
blosc2 byte-shuffle + zstd), so a sample can still be read on its own.
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
from draftsmith.recipe import FINAL_FEATURE_KINDS, Recipe

STORE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0
CONVENTION = {
    "ours": "input-to-layer (HF hidden_states index)",
    "vllm": "same ids (aux_hidden_state_layers are input-to-layer)",
    "sglang": "config ids = ours - 1 (set_eagle3_layers_to_capture adds 1)",
    "specforge": "output-of-layer ids = ours - 1",
}


def default_layer_ids(kind: str, num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high features; heads fed the final hidden state need no layer ids."""
    if kind == "eagle3":
        return [2, num_layers // 2, num_layers - 3]
    return []


def layer_ids_for(recipe: Recipe, num_layers: int) -> list[int]:
    if recipe.head.kind in FINAL_FEATURE_KINDS:
        if recipe.capture.layer_ids:
            raise ValueError(f"capture.layer_ids={recipe.capture.layer_ids}: head.kind={recipe.head.kind} is fed the "
                             "final normed hidden state; layer ids apply to eagle3 only (remove the key)")
        return []
    ids = recipe.capture.layer_ids if recipe.capture.layer_ids is not None else default_layer_ids(recipe.head.kind, num_layers)
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise ValueError(f"capture.layer_ids={ids}: ids must be in [0, {num_layers - 1}] for this target ({bad} are not)")
    return list(ids)


class Skip(torch.nn.Module):
    """Stands in for a decoder layer whose output nobody reads: passes the hidden state through."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class FeatureExtractor:
    """Runs the frozen target's decoder once and returns (aux_BTK, final_BTH) through forward hooks.

    The same object serves offline capture and online training, so both see identical tensors.
    `stop_after_features` skips the decoder layers above the highest id (final is then None)."""

    def __init__(self, model, layer_ids: list[int], stop_after_features: bool = False):
        self.model, self.layer_ids = model, layer_ids
        self.decoder = model.get_decoder()
        self._captured: dict[int, torch.Tensor] = {}
        self.handles = []
        for k in layer_ids:
            module = self.decoder.get_input_embeddings() if k == 0 else self.decoder.layers[k - 1]
            self.handles.append(module.register_forward_hook(self._hook(k)))
        self.skipped = range(max(layer_ids), len(self.decoder.layers)) if stop_after_features and layer_ids else range(0)

    def remove(self) -> None:
        """Detach from the model (another extractor may use it next)."""
        for handle in self.handles:
            handle.remove()

    def _hook(self, k: int):
        def store(_module, _inputs, output):
            self._captured[k] = output[0] if isinstance(output, tuple) else output
        return store

    @torch.no_grad()
    def __call__(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None):
        self._captured.clear()
        layers = self.decoder.layers
        kept = {i: layers[i] for i in self.skipped}
        try:
            for i in self.skipped:
                layers[i] = Skip()
            out = self.decoder(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False)
        finally:
            for i, layer in kept.items():
                layers[i] = layer
        return self.aux(), None if self.skipped else out.last_hidden_state

    def aux(self) -> torch.Tensor | None:
        """The hooked layers' outputs of the last forward, concatenated low to high."""
        return torch.cat([self._captured[k] for k in self.layer_ids], dim=-1) if self.layer_ids else None


class FeatureCompleter:
    """Rebuilds what a compact store leaves out, on the training device, in one decoder pass over a
    partial target (`target.load_target_layers`, layers ids[0]..ids[-1]-1 never loaded): the low
    feature comes out of the first ids[0] layers, the stored high feature is fed into layer ids[-1],
    and the final norm after the last layer gives the teacher."""

    def __init__(self, model, layer_ids: list[int]):
        self.low = FeatureExtractor(model, layer_ids[:1])
        self.hidden = model.config.get_text_config().hidden_size
        self.dtype = model.get_input_embeddings().weight.dtype
        self._high: torch.Tensor | None = None
        self._fed = False
        model.get_decoder().layers[layer_ids[-1]].register_forward_pre_hook(self._feed, with_kwargs=True)

    def _feed(self, _module, args, kwargs):
        """Replace the hidden state entering layer ids[-1] with the stored high feature."""
        self._fed = True
        if args:
            return (self._high,) + tuple(args[1:]), kwargs
        return args, kwargs | {"hidden_states": self._high}

    @torch.no_grad()
    def __call__(self, batch: dict) -> dict:
        """`batch["aux"]` holds the stored features (low feature left out); returns the batch with the
        full aux (low to high) and the teacher hidden state at every position."""
        stored = batch["aux"]
        self._high, self._fed = stored[..., -self.hidden:].to(self.dtype).contiguous(), False
        low, teacher = self.low(batch["input_ids"])
        if not self._fed:
            raise RuntimeError("the target's decoder never ran its layers as expected; set capture.recompute: false")
        self._high = None
        batch["aux"] = torch.cat([low.to(stored.dtype), stored], dim=-1)
        batch["teacher"] = teacher.float()
        return batch


def needed_length(loss_mask: list[int]) -> int:
    """Training reads features up to the position before the last loss-masked token."""
    last = max((i for i, m in enumerate(loss_mask) if m), default=0)
    return max(last, 1)


def teacher_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p whose next token is loss-masked: the target's prediction there is a teacher."""
    return torch.nonzero(loss_mask[1:], as_tuple=False).flatten()


def quantize(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cast for storage; fp8 gets one fp32 scale per row so each token keeps its range."""
    if dtype != "fp8":
        return x.to(STORE_DTYPES[dtype]), None
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return x.float() if scale is None else x.float() * scale.unsqueeze(-1)


def sample_record(input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor | None,
                  final: torch.Tensor | None, dtype: str, keep_aux: int) -> dict:
    """What one sample stores: aux features trimmed to `keep_aux`, the final hidden at teacher
    positions (unless it is recomputed at train time: `final` None)."""
    pos = teacher_positions(loss_mask)
    record = {"input_ids": input_ids.to(torch.int32), "loss_mask": loss_mask.to(torch.uint8), "teacher_pos": pos.to(torch.int32)}
    if final is not None:
        record["teacher"], record["teacher_scale"] = quantize(final[pos], "bf16" if dtype == "fp8" else dtype)
    if aux is not None:
        record["aux"], record["aux_scale"] = quantize(aux[:keep_aux], dtype)
    return record


def batch_records(extractor: FeatureExtractor, rows: dict, dtype: str) -> tuple[list[dict], int]:
    """Run one padded batch of data rows through the target; return (one record per row, real
    tokens). The one code path shared by offline capture, online training and the benchmark."""
    ids, attn = pad_batch(rows["input_ids"])
    device = next(extractor.model.parameters()).device
    aux, final = extractor(ids.to(device), attn.to(device))
    aux, final = (None if t is None else t.cpu() for t in (aux, final))  # records are host tensors (collate pads on host)
    if not extractor.layer_ids:  # heads fed the final hidden: it is their feature, and the teacher where a loss is
        aux, final = final, None
    records = []
    for r, mask in enumerate(rows["loss_mask"]):
        n = len(mask)
        records.append(sample_record(ids[r, :n], torch.tensor(mask), None if aux is None else aux[r, :n],
                                     None if final is None else final[r, :n], dtype, needed_length(mask)))
    return records, int(attn.sum())


def to_sample(get) -> dict:
    """A stored record as the trainer reads it (ids long, features dequantized to fp32);
    `get(key)` returns the record's tensor for `key` or None."""
    aux, teacher = get("aux"), get("teacher")
    return {"input_ids": get("input_ids").long(), "loss_mask": get("loss_mask").long(),
            "teacher_pos": get("teacher_pos").long(),
            "teacher": None if teacher is None else dequantize(teacher, get("teacher_scale")),
            "aux": None if aux is None else dequantize(aux, get("aux_scale"))}


# ---------------------------------------------------------------- shards


COMPRESSED = ("aux", "teacher")  # the feature tensors; ids, masks and scales are too small to bother


def encode(x: torch.Tensor) -> torch.Tensor:
    """Lossless: blosc2 byte-shuffle (bit-shuffle for 1-byte types) + zstd, as a uint8 tensor."""
    import blosc2
    size = x.element_size()
    blob = blosc2.compress2(x.contiguous().view(torch.uint8).numpy(), typesize=size, codec=blosc2.Codec.ZSTD, clevel=1,
                            filters=[blosc2.Filter.SHUFFLE if size > 1 else blosc2.Filter.BITSHUFFLE])
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def decode(blob: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
    import blosc2
    raw = torch.frombuffer(bytearray(blosc2.decompress2(blob.numpy())), dtype=torch.uint8)
    return raw.view(dtype).view(-1, width)


def encode_record(record: dict, compression: str, layout: dict) -> dict:
    """Compress the record's feature tensors; `layout` collects each one's dtype and width (the shard's metadata)."""
    if compression == "none":
        return record
    out = dict(record)
    for key in COMPRESSED:
        if record.get(key) is not None:
            layout[key] = [str(record[key].dtype).removeprefix("torch."), record[key].shape[-1]]
            out[key] = encode(record[key])
    return out


def _concat_shard(records: list[dict], indices: list[int]) -> dict[str, torch.Tensor]:
    """Many samples in one safetensors file: concatenated tensors plus per-key offsets."""
    tensors = {"sample_index": torch.tensor(indices, dtype=torch.int64)}
    for key in records[0]:
        parts = [r[key] for r in records if r[key] is not None]
        if not parts:
            continue
        tensors[key] = torch.cat(parts)
        lengths = torch.tensor([0] + [p.shape[0] for p in parts])
        tensors[f"{key}.offsets"] = torch.cumsum(lengths, 0)
    return tensors


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
            save_file(_concat_shard(self.records, self.indices), str(tmp), metadata=metadata)
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


def make_spec(recipe: Recipe, num_layers: int, hidden_size: int, data_manifest: dict) -> CaptureSpec:
    from draftsmith.data.target import target_fingerprint
    ids = layer_ids_for(recipe, num_layers)
    recompute = recipe.capture.recompute and len(ids) >= 2  # heads without several features store them all
    if recompute and ids != sorted(ids):
        raise ValueError(f"capture.recompute needs ascending capture.layer_ids (got {ids}): the lowest is rebuilt "
                         "from the embedding and the teacher from the highest; sort them or set capture.recompute: false")
    return CaptureSpec(recipe.target.model, target_fingerprint(recipe.target.model), recipe.head.kind, ids,
                       recipe.capture.dtype, hidden_size, data_manifest["inputs_hash"], recompute,
                       ids[1:] if recompute else ids, recipe.capture.compression,
                       "final" if recipe.head.kind in FINAL_FEATURE_KINDS else "layers")


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


def feature_ratio(extractor, dataset, spec: CaptureSpec, num_samples: int = 32) -> float:
    """Compressed / raw feature bytes over evenly spaced samples (nothing written)."""
    if spec.compression == "none":
        return 1.0
    step = max(1, len(dataset) // num_samples)
    records, _ = batch_records(extractor, dataset[list(range(0, len(dataset), step))[:num_samples]], spec.dtype)
    raw = packed = 0
    for record in records:
        for key in COMPRESSED:
            if record.get(key) is not None:
                raw += record[key].numel() * record[key].element_size()
                packed += encode(record[key]).numel()
    return packed / max(raw, 1)


def _batches(dataset, indices: list[int], batch_tokens: int):
    """Length-sorted batches under a padded-token budget, so padding stays small."""
    order = sorted(indices, key=lambda i: len(dataset[i]["input_ids"]))
    batch, longest = [], 0
    for i in order:
        n = len(dataset[i]["input_ids"])
        if batch and max(longest, n) * (len(batch) + 1) > batch_tokens:
            yield batch
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, n)
    if batch:
        yield batch


def pad_batch(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
    return ids, mask


def run_capture(recipe: Recipe, dry_run: bool = False) -> dict:
    """Capture this process's slice (rank::world) of the data; rank 0 merges the manifest."""
    from accelerate import PartialState
    from draftsmith.data.prepare import load_train
    from draftsmith.data.target import load_target
    state = PartialState(cpu=not torch.cuda.is_available())  # gloo across CPU processes when there is no GPU
    dataset, data_manifest = load_train(recipe)
    model = load_target(recipe, state.device)
    cfg = model.config.get_text_config()
    spec = make_spec(recipe, cfg.num_hidden_layers, cfg.hidden_size, data_manifest)
    extractor = FeatureExtractor(model, spec.stored_layer_ids, stop_after_features=spec.recompute)
    if dry_run:
        return projected_bytes(dataset, spec, feature_ratio(extractor, dataset, spec))
    store = capture_dir(recipe)
    if state.is_main_process:
        store.mkdir(parents=True, exist_ok=True)
        _reset_if_other_spec(store, spec)
        remove_orphans(store, read_progress(store))
    state.wait_for_everyone()
    entries = read_progress(store)
    done = {i for e in entries for i in e["samples"]}
    mine = [i for i in range(len(dataset)) if i % state.num_processes == state.process_index and i not in done]
    writer = ShardWriter(store, state.process_index, int(recipe.capture.shard_size_mb * 2**20),
                         first_index=1 + max((int(e["file"][11:16]) for e in entries
                                             if e["file"].startswith(f"shard-r{state.process_index:03d}")), default=-1),
                         compression=spec.compression)
    total = sum(len(dataset[i]["input_ids"]) for i in mine)
    bar = tqdm(total=total, desc="capture", unit="tok", unit_scale=True, mininterval=2.0, disable=not state.is_main_process)
    for batch in _batches(dataset, mine, recipe.capture.batch_tokens):
        records, num_tokens = batch_records(extractor, dataset[batch], spec.dtype)
        for index, record in zip(batch, records):
            writer.add(index, record)
        bar.update(num_tokens)
    writer.flush()
    bar.close()
    state.wait_for_everyone()
    manifest = finalize(recipe, store, spec, len(dataset)) if state.is_main_process else {}
    state.wait_for_everyone()
    return manifest


def _reset_if_other_spec(store: Path, spec: CaptureSpec) -> None:
    """A store begun for another target/layers/dtype/data cannot be resumed: start it over."""
    spec_path = store / "spec.json"
    if spec_path.exists() and artifacts.read_json(spec_path) != spec.as_dict():
        for path in list(store.glob("shard-*")) + list(store.glob("progress-*")) + [store / artifacts.MANIFEST]:
            if path.exists():
                path.unlink()
    artifacts.write_json(spec_path, spec.as_dict())


def finalize(recipe: Recipe, store: Path, spec: CaptureSpec, num_samples: int) -> dict:
    """Merge every rank's progress into the manifest, after checking each sample is there once."""
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
        shards=[{k: e[k] for k in ("file", "sha256", "bytes", "num_tokens")} | {"num_samples": len(e["samples"])} for e in entries])


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
