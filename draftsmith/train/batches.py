"""Batches for the trainer: from the capture store (offline) or the target in-process (online).

Both produce the same per-sample records (`records.sample_record`), so the head sees identical
inputs either way; `to_head_batch` turns records into what a head's loss reads."""
from __future__ import annotations

import torch

from draftsmith.data.capture import batch_records
from draftsmith.data.records import to_sample
from draftsmith.targets.features import FeatureExtractor


def epoch_order(num_samples: int, seed: int, epoch: int, rank: int, world: int, batch_size: int,
                lengths: list[int] | None = None) -> list[list[int]]:
    """Deterministic batches of sample indices for (epoch, rank): resume can skip to any of them. With `lengths`
    (train.group_by_length) the shuffled samples are sorted by length within windows of GROUP_WINDOW global batches
    and the global batches shuffled again: a batch holds samples of similar lengths (little padding, ranks of one
    step equally busy), and every sample still comes once per epoch."""
    gen = torch.Generator().manual_seed(seed * 1000003 + epoch)
    order = torch.randperm(num_samples, generator=gen).tolist()
    group = world * batch_size
    usable = len(order) - len(order) % group if len(order) >= group else len(order)
    if lengths is not None and usable:
        window = group * GROUP_WINDOW
        ranked = [sorted(order[s:min(s + window, usable)], key=lambda i: -lengths[i]) for s in range(0, usable, window)]
        batches = [w[j:j + group] for w in ranked for j in range(0, len(w), group)]
        order = [i for b in torch.randperm(len(batches), generator=gen).tolist() for i in batches[b]] + order[usable:]
    mine = order[:usable][rank::world]
    return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]


GROUP_WINDOW = 64  # global batches whose samples are sorted by length together


class OnlineSource:
    """Runs the frozen target on token batches and returns records exactly as capture stores them."""

    def __init__(self, model, layer_ids: list[int], dataset, tokenizer=None):
        self.extractor, self.dataset, self.tokenizer = FeatureExtractor(model, layer_ids), dataset, tokenizer

    def __len__(self) -> int:
        return len(self.dataset)

    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.dataset["input_ids"]]

    def records(self, indices: list[int]) -> list[dict]:
        records, _ = batch_records(self.extractor, self.dataset[indices], "fp32", self.tokenizer)
        return [to_sample(record.get) for record in records]


class TokenSource:
    """Token records only (ids, loss mask, teacher positions): for joint training, where the model
    being trained runs the target itself."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.dataset["input_ids"]]

    def records(self, indices: list[int]) -> list[dict]:
        from draftsmith.data.records import teacher_positions
        out, rows = [], self.dataset[indices]  # a datasets batch: columns of lists
        for ids, mask in zip(rows["input_ids"], rows["loss_mask"]):
            ids, mask = torch.tensor(ids), torch.tensor(mask)
            out.append({"input_ids": ids, "loss_mask": mask, "teacher_pos": teacher_positions(mask), "teacher": None, "aux": None})
        return out


class OfflineSource:
    """Samples from the capture store. A corrupt sample (checksum mismatch) stops training, or with
    `train.corrupt_samples: skip` is replaced by an empty, fully masked one (no loss, no gradient; every
    process keeps the same batch shape and step) and counted in `num_corrupt`."""

    def __init__(self, store, on_corrupt: str = "fail"):
        self.store, self.on_corrupt, self.num_corrupt = store, on_corrupt, 0

    def __len__(self) -> int:
        return len(self.store)

    def lengths(self) -> list[int]:
        return self.store.lengths()

    def records(self, indices: list[int]) -> list[dict]:
        return [self._read(i) for i in indices]

    def _read(self, i: int) -> dict:
        from draftsmith.data.store import CorruptSample
        try:
            return self.store[i]
        except CorruptSample as exc:
            if self.on_corrupt != "skip":
                raise
            self.num_corrupt += 1
            print(f"skipped: {exc}", flush=True)
            return self._masked_stub()

    def _masked_stub(self) -> dict:
        m = self.store.manifest
        final = m.get("feature") == "final"
        width = m["hidden_size"] * (1 if final else len(m["stored_layer_ids"]))
        teacher = None if (m.get("recompute") or final) else torch.zeros(0, m["hidden_size"])
        return {"input_ids": torch.zeros(2, dtype=torch.long), "loss_mask": torch.zeros(2, dtype=torch.long),
                "teacher_pos": torch.zeros(0, dtype=torch.long), "teacher": teacher, "aux": torch.zeros(1, width)}


def collate(records: list[dict], max_tokens: int) -> dict:
    """Right-pad to the longest sample (cut at max_tokens); teacher hiddens scattered to positions
    (a compact store has none: `FeatureCompleter` rebuilds them on the device)."""
    T = min(max(len(r["input_ids"]) for r in records), max_tokens)
    B, has_aux = len(records), records[0]["aux"] is not None
    stored_teacher = records[0]["teacher"] is not None
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.long), "has_teacher": torch.zeros(B, T, dtype=torch.bool)}
    if has_aux:
        batch["aux"] = torch.zeros(B, T, records[0]["aux"].shape[-1])
    if stored_teacher:
        batch["teacher"] = torch.zeros(B, T, records[0]["teacher"].shape[-1])
    for b, r in enumerate(records):
        n = min(len(r["input_ids"]), T)
        batch["input_ids"][b, :n] = r["input_ids"][:n]
        if has_aux:
            k = min(r["aux"].shape[0], T)
            batch["aux"][b, :k] = r["aux"][:k]
        keep = r["teacher_pos"] < T
        pos = r["teacher_pos"][keep]
        if stored_teacher:
            batch["teacher"][b, pos] = r["teacher"][keep].to(batch["teacher"].dtype)
        batch["has_teacher"][b, pos] = True
    batch["position_ids"] = torch.arange(T).expand(B, T).contiguous()
    return batch


TEACHER_BUDGET = 2 ** 28  # teacher probabilities (batch x positions x draft vocabulary) held whole up to this


class StreamedTeacher:
    """The teacher's distribution over the draft vocabulary, computed per slice `[:, lo:hi]` (or at the
    positions `[batch_idx, rows]` of two index tensors, as the block drafters' anchors read it) from the
    target's hidden states and lm_head (fp32), for samples too long to hold [T, V] whole."""

    def __init__(self, teacher_BTH, has_BT, lm_head_VH, draft_to_target):
        self.teacher, self.has = teacher_BTH, has_BT
        whole = len(draft_to_target) == lm_head_VH.shape[0]  # the full vocabulary: no copy of the rows
        self.weight_VH = (lm_head_VH.detach() if whole else lm_head_VH.detach()[draft_to_target]).float()
        self.shape = (*has_BT.shape, len(draft_to_target))

    @torch.no_grad()
    def __getitem__(self, key):
        rows, cols = key
        if torch.is_tensor(rows) and torch.is_tensor(cols):
            has, teacher = self.has[rows, cols], self.teacher[rows, cols]
        else:
            assert rows == slice(None), "a streamed teacher is sliced by position, or read at [batch_idx, rows]"
            has, teacher = self.has[:, cols], self.teacher[:, cols]
        probs = torch.zeros(*has.shape, self.shape[-1], device=self.teacher.device)
        probs[has] = torch.softmax(teacher[has].float() @ self.weight_VH.T, dim=-1)
        return probs


@torch.no_grad()
def teacher_targets(batch: dict, lm_head_VH: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                    budget: int | None = None) -> dict:
    """Teacher distribution over the draft vocabulary, in fp32, only where a teacher exists and its
    argmax lies inside the draft vocabulary. Held whole while batch x positions x vocabulary fits in
    `budget`, else streamed (`StreamedTeacher`); the full-vocabulary argmax goes in position blocks."""
    has, teacher, budget = batch.pop("has_teacher"), batch.pop("teacher"), budget or TEACHER_BUDGET
    B, T = has.shape
    draft_to_target = d2t + torch.arange(len(d2t), device=d2t.device)
    target_to_draft = torch.full((len(t2d),), -1, dtype=torch.long, device=d2t.device)
    target_to_draft[draft_to_target] = torch.arange(len(d2t), device=d2t.device)
    rows = teacher[has]
    block = max(1, budget // (4 * len(t2d)))
    full_argmax = torch.cat([(rows[s:s + block].float() @ lm_head_VH.float().T).argmax(-1)
                             for s in range(0, len(rows), block)]) if len(rows) else rows.new_zeros(0, dtype=torch.long)
    streamed = StreamedTeacher(teacher, has, lm_head_VH, draft_to_target)
    probs = streamed[:, :] if B * T * len(d2t) <= budget else streamed
    valid = torch.zeros(B, T, dtype=torch.bool, device=teacher.device)
    valid[has] = t2d[full_argmax]
    argmax = torch.full((B, T), -1, dtype=torch.long, device=teacher.device)
    argmax[has] = target_to_draft[full_argmax]
    batch.update(target_probs=probs, target_valid=valid, target_argmax=argmax)
    return batch


class Subset:
    """A view of a source through a list of sample indices (the train / eval split)."""

    def __init__(self, source, indices: list[int]):
        self.source, self.indices = source, indices

    def __len__(self) -> int:
        return len(self.indices)

    def records(self, idx: list[int]) -> list[dict]:
        return self.source.records([self.indices[i] for i in idx])

    def lengths(self) -> list[int]:
        every = self.source.lengths()
        return [every[i] for i in self.indices]

    @property
    def num_corrupt(self) -> int:
        return getattr(self.source, "num_corrupt", 0)


def split_indices(num_samples: int, every: int = 20) -> tuple[list[int], list[int]]:
    """Every `every`-th sample is held out for evaluation (none when the set is tiny)."""
    if num_samples < 2 * every:
        return list(range(num_samples)), []
    train = [i for i in range(num_samples) if i % every]
    return train, [i for i in range(num_samples) if i % every == 0]
