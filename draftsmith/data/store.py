"""Reading the capture store: a memory-mapped `torch.utils.data.Dataset` that checks its manifest."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith import artifacts
from draftsmith.data.capture import to_sample


class CaptureStore(torch.utils.data.Dataset):
    """Serves one sample at a time as float tensors: input_ids, loss_mask, aux_TK, teacher_MH, teacher_pos.

    `expected` holds the fields the consumer needs to match (target, layers, dtype, head kind);
    any difference is a clear error rather than a silently wrong head."""

    def __init__(self, store: str | Path, expected: dict | None = None, verify: bool = False):
        self.store = Path(store)
        self.manifest = artifacts.read_manifest(self.store, "capture")
        if expected:
            artifacts.check_upstream(self.manifest, expected, f"capture store {self.store}")
        if verify:
            from draftsmith.data.capture import verify as verify_store
            problems = verify_store(self.store)
            if problems:
                raise artifacts.ArtifactError("; ".join(problems))
        self.handles = {}
        self.index: list[tuple[str, int]] = []
        located = {}
        for shard in self.manifest["shards"]:
            with safe_open(str(self.store / shard["file"]), framework="pt") as handle:
                for local, sample in enumerate(handle.get_tensor("sample_index").tolist()):
                    located[sample] = (shard["file"], local)
        self.index = [located[i] for i in range(self.manifest["num_samples"])]

    def __len__(self) -> int:
        return len(self.index)

    def _handle(self, name: str):
        if name not in self.handles:  # opened lazily so each DataLoader worker maps its own
            self.handles[name] = safe_open(str(self.store / name), framework="pt")
        return self.handles[name]

    def _slice(self, handle, key: str, local: int) -> torch.Tensor | None:
        if f"{key}.offsets" not in handle.keys():
            return None
        offsets = handle.get_slice(f"{key}.offsets")[local:local + 2].tolist()
        return handle.get_slice(key)[offsets[0]:offsets[1]]

    def __getitem__(self, i: int) -> dict:
        name, local = self.index[i]
        handle = self._handle(name)
        return to_sample(lambda key: self._slice(handle, key, local))
