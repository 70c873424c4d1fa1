"""What each stage writes and the next one checks: manifests, atomic files, checkpoints."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"


class ArtifactError(ValueError):
    """A stage's input is missing, incomplete or made for another recipe."""


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary sibling path; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        yield tmp_path
        if tmp_path.exists():
            os.replace(tmp_path, path)
    finally:
        if tmp_path.is_dir():
            shutil.rmtree(tmp_path, ignore_errors=True)
        elif tmp_path.exists():
            tmp_path.unlink()


def write_json(path: str | Path, data: dict) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: str | Path) -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path} is not valid JSON: {exc}") from None


def write_manifest(directory: str | Path, stage: str, inputs_hash: str, **fields) -> dict:
    """Write the stage manifest last, so its presence means the stage completed."""
    manifest = {"stage": stage, "inputs_hash": inputs_hash, "complete": True,
                "written_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **fields}
    write_json(Path(directory) / MANIFEST, manifest)
    return manifest


def read_manifest(directory: str | Path, stage: str) -> dict:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise ArtifactError(f"{directory}: no {MANIFEST}; run `draftsmith {stage}` first")
    manifest = read_json(path)
    if manifest.get("stage") != stage or not manifest.get("complete"):
        raise ArtifactError(f"{path}: expected a complete '{stage}' manifest, found {manifest.get('stage')!r}")
    return manifest


def stage_is_current(directory: str | Path, stage: str, inputs_hash: str) -> bool:
    """True when `directory` holds a complete manifest of `stage` made from the same inputs."""
    try:
        manifest = read_manifest(directory, stage)
    except ArtifactError:
        return False
    return manifest.get("inputs_hash") == inputs_hash


def check_upstream(manifest: dict, expected: dict, where: str) -> None:
    """Raise naming each field where an upstream manifest disagrees with what this stage expects."""
    problems = [f"{key}: store has {manifest.get(key)!r}, recipe expects {value!r}"
                for key, value in expected.items() if manifest.get(key) != value]
    if problems:
        raise ArtifactError(f"{where} was made for something else: " + "; ".join(problems))


def save_checkpoint(directory: str | Path, tensors: dict[str, torch.Tensor], metadata: dict, write_extra=None) -> None:
    """A head checkpoint: model.safetensors + head.json (+ whatever `write_extra(dir)` adds, e.g. a
    LoRA adapter), written to a temp dir and renamed."""
    directory = Path(directory)
    with atomic_path(directory) as tmp:
        tmp.mkdir(parents=True)
        if write_extra is not None:
            write_extra(tmp)
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
        metadata = {**metadata, "sha256": sha256_file(tmp / "model.safetensors")}
        (tmp / "head.json").write_text(json.dumps(metadata, indent=2, default=str))
        if directory.exists():
            shutil.rmtree(directory)


def load_checkpoint(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    directory = Path(directory)
    meta_path, weights = directory / "head.json", directory / "model.safetensors"
    if not meta_path.exists() or not weights.exists():
        raise ArtifactError(f"{directory}: not a draftsmith head checkpoint (needs head.json and model.safetensors)")
    metadata = read_json(meta_path)
    if metadata.get("sha256") and sha256_file(weights) != metadata["sha256"]:
        raise ArtifactError(f"{weights}: checksum mismatch; the checkpoint is corrupt")
    return load_file(str(weights)), metadata
