"""Reading the capture store: a memory-mapped `torch.utils.data.Dataset` that checks its manifest."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith import artifacts
from draftsmith.data.records import decode, to_sample


class CaptureStore(torch.utils.data.Dataset):
    """Serves one sample at a time as float tensors: input_ids, loss_mask, aux_TK, teacher_MH (None
    when the store leaves it to be recomputed), teacher_pos. Compressed features are decoded here.

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
            handle = safe_open(str(self.store / name), framework="pt")
            encoded = json.loads((handle.metadata() or {}).get("encoded", "{}"))
            self.handles[name] = handle, {k: (getattr(torch, dtype), width) for k, (dtype, width) in encoded.items()}
        return self.handles[name]

    def _slice(self, opened, key: str, local: int) -> torch.Tensor | None:
        handle, encoded = opened
        if f"{key}.offsets" not in handle.keys():
            return None
        offsets = handle.get_slice(f"{key}.offsets")[local:local + 2].tolist()
        data = handle.get_slice(key)[offsets[0]:offsets[1]]
        return decode(data, *encoded[key]) if key in encoded else data

    def __getitem__(self, i: int) -> dict:
        name, local = self.index[i]
        handle = self._handle(name)
        return to_sample(lambda key: self._slice(handle, key, local))
