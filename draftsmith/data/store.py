"""Reading the capture store: a memory-mapped `torch.utils.data.Dataset` that checks its manifest."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith import artifacts
from draftsmith.data.records import checksum, decode, to_sample


class CorruptSample(artifacts.ArtifactError):
    """A stored sample whose bytes do not match its checksum, or cannot be decoded."""


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
            try:
                with safe_open(str(self.store / shard["file"]), framework="pt") as handle:
                    for local, sample in enumerate(handle.get_tensor("sample_index").tolist()):
                        located[sample] = (shard["file"], local)
            except Exception as exc:  # noqa: BLE001  (a torn or corrupt file: name it, whatever the library raised)
                raise CorruptSample(f"{self.store / shard['file']}: unreadable shard ({type(exc).__name__}: {exc}); "
                                    "`draftsmith capture --verify` checks the whole store") from None
        missing = [i for i in range(self.manifest["num_samples"]) if i not in located]
        if missing:
            raise CorruptSample(f"{self.store}: samples {missing[:5]} are in no shard's sample_index "
                                "(`draftsmith capture --verify` names the corrupt shards)")
        self.index = [located[i] for i in range(self.manifest["num_samples"])]

    def __len__(self) -> int:
        return len(self.index)

    def lengths(self) -> list[int]:
        """Every sample's token count, from the shards' offsets (no sample is read)."""
        out = [0] * len(self.index)
        for shard in self.manifest["shards"]:
            handle, _ = self._handle(shard["file"])
            counts = handle.get_tensor("input_ids.offsets").diff().tolist()
            for local, sample in enumerate(handle.get_tensor("sample_index").tolist()):
                out[sample] = counts[local]
        return out

    def _handle(self, name: str):
        if name not in self.handles:  # opened lazily so each DataLoader worker maps its own
            handle = safe_open(str(self.store / name), framework="pt")
            encoded = json.loads((handle.metadata() or {}).get("encoded", "{}"))
            self.handles[name] = handle, {k: (getattr(torch, dtype), width) for k, (dtype, width) in encoded.items()}
        return self.handles[name]

    def _raw(self, handle, key: str, local: int) -> torch.Tensor:
        offsets = handle.get_slice(f"{key}.offsets")[local:local + 2].tolist()
        return handle.get_slice(key)[offsets[0]:offsets[1]]

    def __getitem__(self, i: int) -> dict:
        """Sample i, its stored bytes checked against the shard's crc32 first."""
        name, local = self.index[i]
        handle, encoded = self._handle(name)
        keys = [k.removesuffix(".offsets") for k in handle.keys() if k.endswith(".offsets")]
        try:
            raw = {key: self._raw(handle, key, local) for key in keys}
            if "crc32" in handle.keys() and checksum(raw) != handle.get_slice("crc32")[local:local + 1].tolist()[0]:
                raise ValueError("crc32 mismatch")
            decoded = {key: decode(t, *encoded[key]) if key in encoded else t for key, t in raw.items()}
        except Exception as exc:  # noqa: BLE001  (flipped bytes surface as any decoding error)
            raise CorruptSample(f"{self.store / name}: sample {i} (entry {local} of the shard) is corrupt "
                                f"({type(exc).__name__}: {exc}); set train.corrupt_samples: skip to train on the rest, "
                                "or recapture") from None
        return to_sample(decoded.get)
