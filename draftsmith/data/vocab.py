"""Draft vocabulary: the N most frequent loss-masked target tokens, as EAGLE-3's d2t/t2d maps.

target_id = draft_id + d2t[draft_id]; t2d[target_id] is True when the token is in the draft vocab.
Ids are sorted ascending. With fewer distinct tokens than N the set is padded with unused ids
(lowest first), so shapes always match the config. Cached by data hash."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from draftsmith import artifacts


def count_tokens(input_ids: list[list[int]], loss_masks: list[list[int]]) -> Counter:
    counts = Counter()
    for ids, mask in zip(input_ids, loss_masks):
        counts.update(t for t, m in zip(ids, mask) if m)
    return counts


def build_vocab(counts: Counter, vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Return (d2t int64[N], t2d bool[V], report with coverage)."""
    if draft_vocab_size > vocab_size:
        raise ValueError(f"head.draft_vocab_size={draft_vocab_size} exceeds the target vocabulary ({vocab_size})")
    used = [token for token, _ in counts.most_common(draft_vocab_size)]
    chosen = set(used)
    padding = (t for t in range(vocab_size) if t not in chosen)
    while len(used) < draft_vocab_size:
        used.append(next(padding))
    used.sort()
    ids = torch.tensor(used, dtype=torch.long)
    d2t = ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    total = sum(counts.values())
    covered = sum(c for t, c in counts.items() if t2d[t])
    report = {"draft_vocab_size": draft_vocab_size, "num_distinct_tokens": len(counts),
              "num_padded": max(0, draft_vocab_size - len(counts)), "coverage": covered / max(total, 1)}
    return d2t, t2d, report


def load_or_build(cache_dir: Path, data_hash: str, dataset, vocab_size: int, draft_vocab_size: int):
    """Cached by (data hash, sizes), so a stale map from other data is never reused."""
    path = Path(cache_dir) / f"vocab-{data_hash}-{vocab_size}-{draft_vocab_size}.pt"
    if path.exists():
        cached = torch.load(path)
        return cached["d2t"], cached["t2d"], cached["report"]
    counts = count_tokens(dataset["input_ids"], dataset["loss_mask"])
    d2t, t2d, report = build_vocab(counts, vocab_size, draft_vocab_size)
    with artifacts.atomic_path(path) as tmp:
        torch.save({"d2t": d2t, "t2d": t2d, "report": report}, tmp)
    return d2t, t2d, report
