"""Regeneration: replace every assistant turn with the target's own answer.

Training on what the target itself says is what raises acceptance: the head learns the target's
distribution, not the dataset author's. Resumable: finished conversations are appended to a JSONL
file and skipped on rerun. regenerated + skipped + failed always equals the input count."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.recipe import Recipe


def _load_done(path: Path) -> dict[str, dict]:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill; that conversation is redone
            done[record["id"]] = record
    return done


@torch.no_grad()
def _answer(model, tokenizer, histories: list[list[dict]], cfg) -> list[str]:
    from draftsmith.data.conversations import render
    prompts = [render(tokenizer, h, generation_prompt=True) for h in histories]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    sample = cfg.temperature > 0
    out = model.generate(**batch, max_new_tokens=cfg.max_new_tokens, do_sample=sample,
                         temperature=cfg.temperature if sample else None, top_p=None, top_k=None,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return [tokenizer.decode(row[batch["input_ids"].shape[1]:], skip_special_tokens=True).strip() for row in out]


def _regenerate_batch(model, tokenizer, batch: list[dict], cfg) -> list[dict]:
    """Walk the conversations turn by turn; each assistant turn sees the regenerated history."""
    new = [{"id": c["id"], "messages": []} for c in batch]
    for turn in range(max(len(c["messages"]) for c in batch)):
        asking = [i for i, c in enumerate(batch) if turn < len(c["messages"]) and c["messages"][turn]["role"] == "assistant"]
        for i, c in enumerate(batch):
            if turn < len(c["messages"]) and i not in asking:
                new[i]["messages"].append(c["messages"][turn])
        if asking:
            answers = _answer(model, tokenizer, [new[i]["messages"] for i in asking], cfg)
            for i, text in zip(asking, answers):
                new[i]["messages"].append({"role": "assistant", "content": text})
    return new


def regenerate(recipe: Recipe, tokenizer, items: list[dict], out_path: Path) -> tuple[list[dict], dict]:
    """Return (regenerated conversations, counts). Already-finished ids are read back from out_path."""
    from draftsmith.targets.loading import load_target
    cfg = recipe.data.regen
    done = _load_done(out_path)
    todo = [c for c in items if "messages" in c and c["id"] not in done]
    counts = {"input": len(items), "regenerated": 0, "reused": 0, "skipped": 0, "failed": 0}
    counts["skipped"] = sum(1 for c in items if "messages" not in c)
    model = load_target(recipe) if todo else None
    with open(out_path, "a", encoding="utf-8") as handle:
        if out_path.stat().st_size and not out_path.read_bytes().endswith(b"\n"):
            handle.write("\n")  # close a line torn by a kill, so new records start clean
        for start in tqdm(range(0, len(todo), cfg.batch_size), desc="regen", unit="batch", mininterval=2.0):
            batch = todo[start:start + cfg.batch_size]
            try:
                results = _regenerate_batch(model, tokenizer, batch, cfg)
            except (RuntimeError, ValueError):
                counts["failed"] += len(batch)
                continue
            for record in results:
                handle.write(json.dumps(record) + "\n")
                done[record["id"]] = record
            handle.flush()
            counts["regenerated"] += len(batch)
    counts["reused"] = sum(1 for c in items if "messages" in c and c["id"] in done) - counts["regenerated"]
    result = [done.get(c["id"], c) for c in items]  # failed or text-only ones keep their original form
    assert counts["regenerated"] + counts["reused"] + counts["skipped"] + counts["failed"] == counts["input"]
    return result, counts
