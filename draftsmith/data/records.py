"""The capture store's on-disk format, shared by the writer (`capture.py`) and the reader (`store.py`).

A record is one sample: input_ids (int32), loss_mask (uint8), teacher_pos (int32: positions whose
next token is loss-masked), and optionally `aux` (features up to the last position training reads)
and `teacher` (final hidden at teacher positions), each cast to the store dtype; fp8 rows carry one
fp32 scale (`aux_scale`, `teacher_scale`). A shard concatenates records per key with `<key>.offsets`
and `sample_index`; feature tensors may be compressed (`encoded` shard metadata: key -> [dtype, width]).
`crc32` holds one checksum per sample over its stored bytes (keys in sorted order), checked on
every read, so a corrupt sample is caught by the trainer, not only by `capture --verify`."""
from __future__ import annotations

import zlib

import torch

STORE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0


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


def to_sample(get) -> dict:
    """A stored record as the trainer reads it (ids long, features dequantized to fp32);
    `get(key)` returns the record's tensor for `key` or None."""
    aux, teacher = get("aux"), get("teacher")
    return {"input_ids": get("input_ids").long(), "loss_mask": get("loss_mask").long(),
            "teacher_pos": get("teacher_pos").long(),
            "teacher": None if teacher is None else dequantize(teacher, get("teacher_scale")),
            "aux": None if aux is None else dequantize(aux, get("aux_scale"))}


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


def stored_bytes(tensor: torch.Tensor):
    return tensor.contiguous().view(torch.uint8).numpy()


def checksum(record: dict) -> int:
    """crc32 of a stored (encoded) record's bytes, keys in sorted order."""
    crc = 0
    for key in sorted(k for k, v in record.items() if v is not None):
        crc = zlib.crc32(stored_bytes(record[key]), crc)
    return crc


def concat_shard(records: list[dict], indices: list[int]) -> dict[str, torch.Tensor]:
    """Many samples in one safetensors file: concatenated tensors plus per-key offsets and checksums."""
    tensors = {"sample_index": torch.tensor(indices, dtype=torch.int64),
               "crc32": torch.tensor([checksum(r) for r in records], dtype=torch.int64)}
    for key in records[0]:
        parts = [r[key] for r in records if r[key] is not None]
        if not parts:
            continue
        tensors[key] = torch.cat(parts)
        lengths = torch.tensor([0] + [p.shape[0] for p in parts])
        tensors[f"{key}.offsets"] = torch.cumsum(lengths, 0)
    return tensors
