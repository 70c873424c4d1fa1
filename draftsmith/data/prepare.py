"""The data stage: sources -> (optional regeneration) -> tokens + loss masks as an Arrow dataset."""
from __future__ import annotations

import hashlib
import itertools
import json
import random
from pathlib import Path

from tqdm import tqdm

from draftsmith import artifacts
from draftsmith.data import conversations as conv
from draftsmith.data import images
from draftsmith.recipe import Recipe
from draftsmith.targets import code_images, stdlib


def data_dir(recipe: Recipe) -> Path:
    return recipe.run_dir / "data"


def inputs_hash(recipe: Recipe) -> str:
    return recipe.section_hash("target", "data")


def _split_heldout(rid: str, fraction: float) -> bool:
    return int(hashlib.sha256(rid.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction


def collect(recipe: Recipe, skips: conv.SkipCounter, answering: bool = False,
            reads_images: bool = False) -> tuple[list[dict], list[dict], int]:
    """Read every source; return (train conversations, held-out conversations, records read). A prompt
    without an answer (no assistant turn) is refused unless the target will answer it (`answering`); a
    conversation with images, unless the target reads them (`reads_images`: an image-text target, which also
    answers image prompts when regenerating)."""
    cfg = recipe.data
    train, heldout, num_read, drawn = [], [], 0, set()
    if cfg.builtin is not None:  # stdlib, or stdlib-images (the recipe checked the target draws them)
        for module in stdlib.list_modules():
            items = stdlib.function_conversations(module)
            if cfg.builtin == "stdlib-images":  # drawn below, once the conversations kept are known
                drawn.update(c["id"] for c in items if code_images.is_image_item(c["id"]))
            num_read += len(items)
            (heldout if stdlib.is_heldout(module.name, cfg.heldout_fraction) else train).extend(items)
    for index, source in enumerate(cfg.sources):
        records = conv.read_records(source.path, cfg.bad_lines, skips, source)
        base_dir = Path(source.path).parent if Path(source.path).suffix in (".jsonl", ".json") else None
        for where, record in itertools.islice(records, source.max_records):
            num_read += 1
            try:
                item = conv.normalize(record, where, source.format, base_dir)
                if "messages" in item and images.has_images(item["messages"]):
                    images.check_images(item["messages"], where)  # read once: a bad image is a bad record
                    if not reads_images:
                        _refuse_images(recipe, where)
            except (conv.DataError, images.ImageError) as exc:
                if isinstance(exc, ImagesNeedATarget):
                    raise
                if cfg.bad_lines == "fail":
                    raise conv.DataError(str(exc)) from None
                skips.skip("bad_image" if isinstance(exc, images.ImageError) else "bad_record", where)
                continue
            unanswered = "messages" in item and not any(m["role"] == "assistant" for m in item["messages"])
            if unanswered and not answering:
                raise conv.DataError(f"{where}: record {item['id']!r} is a prompt without an answer (no assistant turn); "
                                     "set data.regen.enabled: true (or pass --regen) to have the target answer it")
            (heldout if _split_heldout(item["id"], cfg.heldout_fraction) else train).append(item)
    num_read += skips.reasons["malformed_json"] + skips.reasons["invalid_utf8"]  # lines that never became a record
    if cfg.max_conversations is not None and len(train) > cfg.max_conversations:
        rng = random.Random(recipe.seed)
        rng.shuffle(train)
        skips.reasons["over_max_conversations"] += len(train) - cfg.max_conversations
        train = train[:cfg.max_conversations]
    if drawn:  # drawn in the target's tokens, one a patch (its tokenizer is there: the target stage ran)
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(recipe.target.model)
        train, heldout = ([code_images.as_image_conversation(c, recipe.target.embedded.vision, tokenizer) if c["id"] in drawn
                           else c for c in items] for items in (train, heldout))
    return train, heldout, num_read


def encode_all(recipe: Recipe, tokenizer, items: list[dict], skips: conv.SkipCounter) -> dict:
    """Tokenize and mask; apply the max-length policy; count every drop by reason."""
    cfg = recipe.data
    columns = {"id": [], "input_ids": [], "loss_mask": []}
    with_images = any("messages" in item and images.has_images(item["messages"]) for item in items)
    if with_images:
        columns["images"] = []  # each row's image sources, in order: capture runs the target's image processor on them
    for item in tqdm(items, desc="data", unit="conv", mininterval=1.0):
        if "messages" in item and not any(m["role"] == "assistant" for m in item["messages"]):
            skips.skip("no_assistant_turn", item["id"])
            continue
        try:
            ids, mask = conv.encode_conversation(tokenizer, item, cfg.system_prompt)
        except conv.DataError:
            skips.skip("template_mismatch", item["id"])
            continue
        except images.ImageError:
            skips.skip("bad_image", item["id"])
            continue
        if len(ids) > cfg.max_length:
            if cfg.overflow == "drop":
                skips.skip("too_long", item["id"])
                continue
            ids, mask = ids[:cfg.max_length], mask[:cfg.max_length]
        if sum(mask) == 0:
            skips.skip("no_loss_tokens", item["id"])
            continue
        columns["id"].append(item["id"])
        columns["input_ids"].append(ids)
        columns["loss_mask"].append(mask)
        if with_images:
            columns["images"].append(images.images_of(item["messages"]) if "messages" in item else [])
    return columns


def run_data(recipe: Recipe, regen: bool | None = None) -> dict:
    """Build `<run>/data/`: `train` Arrow dataset, `heldout.jsonl` prompts, manifest."""
    import datasets
    from draftsmith.targets.loading import load_tokenizer, target_fingerprint
    tokenizer = load_tokenizer(recipe)
    conv.check_tokenizer(tokenizer, f"target.model={recipe.target.model!r}")
    skips = conv.SkipCounter()
    answering = regen if regen is not None else recipe.data.regen.enabled
    train, heldout, num_read = collect(recipe, skips, answering, getattr(tokenizer, "draftsmith_processor", None) is not None)
    _refuse_empty(recipe, "conversations", len(train) + len(heldout), num_read, skips)
    out = data_dir(recipe)
    out.mkdir(parents=True, exist_ok=True)
    regen_counts = None
    if answering:
        from draftsmith.data.regen import regenerate
        # keyed by the target's fingerprint: answers of another (or retrained) target are never reused
        train, regen_counts = regenerate(recipe, tokenizer, train, out / f"regen-{target_fingerprint(recipe.target.model)}.jsonl")
        from draftsmith.targets.parallel import is_first_rank
        if not is_first_rank():  # a sharded target's other ranks helped generate; rank 0 writes the stage
            return {}
    columns = encode_all(recipe, tokenizer, train, skips)
    _refuse_empty(recipe, "training conversations with assistant (loss) tokens", len(columns["id"]), num_read, skips)
    with artifacts.atomic_path(out / "train") as tmp:
        datasets.Dataset.from_dict(columns).save_to_disk(str(tmp))
        _remove(out / "train")
    with artifacts.atomic_path(out / "heldout.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(item) + "\n" for item in heldout))
    num_tokens = sum(map(len, columns["input_ids"]))
    num_loss = sum(map(sum, columns["loss_mask"]))
    manifest = artifacts.write_manifest(
        out, "data", inputs_hash(recipe), target_id=recipe.target.model,
        target_fingerprint=target_fingerprint(recipe.target.model), template_hash=conv.template_hash(tokenizer),
        num_records_read=num_read, num_train_conversations=len(columns["id"]),
        num_heldout_conversations=len(heldout), num_tokens=num_tokens, num_loss_tokens=num_loss,
        num_skipped=dict(skips.reasons), skip_examples=skips.examples, regeneration=regen_counts,
        max_length=recipe.data.max_length, overflow=recipe.data.overflow)
    return manifest


def _sources(recipe: Recipe) -> str:
    named = [f"data.sources[{i}].path={s.path!r}" for i, s in enumerate(recipe.data.sources)]
    return ", ".join(named + ([f"data.builtin={recipe.data.builtin!r}"] if recipe.data.builtin else [])) or "no data.sources"


class ImagesNeedATarget(conv.DataError):
    """Image conversations for a target that cannot read them."""


def _refuse_images(recipe: Recipe, where: str) -> None:
    """Image conversations are read and checked; tokenizing them needs an image-text target's processor, which a
    text target has not: say so rather than drop the images."""
    raise ImagesNeedATarget(f"{where}: the conversation holds images; target {recipe.target.model!r} reads text only "
                            "(no vision tower, no processor): point target.model at an image-text model "
                            "(AutoModelForImageTextToText with its processor), or remove the image parts")


def _refuse_empty(recipe: Recipe, what: str, count: int, num_read: int, skips: conv.SkipCounter) -> None:
    """Zero rows is an error here, not stages later; nothing is written (the manifest comes last)."""
    if count == 0:
        skipped = {k: v for k, v in skips.reasons.items() if v}
        raise conv.DataError(f"{recipe.source_path}: the data stage found no {what} in {_sources(recipe)} "
                             f"({num_read} records read, skipped: {skipped or 'none'}); check the files, "
                             "data.max_length and data.max_conversations")


def _remove(path: Path) -> None:
    import shutil
    if path.exists():
        shutil.rmtree(path)


def load_train(recipe: Recipe):
    """The data stage's dataset, after checking its manifest belongs to this recipe's target."""
    import datasets
    from draftsmith.targets.loading import target_fingerprint
    manifest = artifacts.read_manifest(data_dir(recipe), "data")
    artifacts.check_upstream(manifest, {"target_id": recipe.target.model,
                                        "target_fingerprint": target_fingerprint(recipe.target.model)},
                             f"{data_dir(recipe)}")
    return datasets.load_from_disk(str(data_dir(recipe) / "train")), manifest


def load_heldout(recipe: Recipe) -> list[dict]:
    path = data_dir(recipe) / "heldout.jsonl"
    if not path.exists():
        raise artifacts.ArtifactError(f"{path} does not exist; run `draftsmith data` first")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
