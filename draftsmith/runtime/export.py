"""`draftsmith export`: write a validated head in an engine's layout. The layouts themselves live in
the kind's formats module (heads/<kind>/formats.py: `ADAPTERS`, `REQUIRED`, `model_card`,
`serve_command`); this stage checks the validation, dispatches by the checkpoint's kind, and writes
config.json + model.safetensors + README.md (model card) atomically.

Export refuses a head without a passing validation.json for its target unless explicitly overridden."""
from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith import artifacts
from draftsmith.heads.registry import head_spec
from draftsmith.runtime import check


def find_validation(head: Path) -> Path | None:
    for candidate in (head / "validation.json", head.parent / "validate" / "validation.json"):
        if candidate.exists():
            return candidate
    return None


def find_economics(head: Path) -> dict | None:
    """The measured best K and schedule of `draftsmith economics` for exactly these weights, if any."""
    path = head.parent / "economics" / "economics.json"
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    if result.get("head_sha256") != artifacts.sha256_file(head / "model.safetensors"):
        return None  # measured for other weights: the card keeps the kind's default K
    summary = result["drafters"][result["kind"]]
    return {"best_k": summary["low_batch"]["k"], "schedule": summary["schedule"], "machine": result["machine"],
            "crossover_batch_size": summary["crossover_batch_size"]}


def check_validated(head: Path, target: str) -> dict:
    """The head's validation.json must exist, name this head's weights and this target, and pass."""
    path = find_validation(head)
    if path is None:
        raise ValueError(f"{head}: no validation.json (run `draftsmith validate` first, or pass --allow-unvalidated)")
    result = json.loads(path.read_text())
    sha = artifacts.sha256_file(head / "model.safetensors")
    if result.get("head_sha256") != sha:
        raise ValueError(f"{path} validated other weights than {head} (re-run `draftsmith validate`, or --allow-unvalidated)")
    if target and result.get("target") != target:
        raise ValueError(f"{path} validated against target {result.get('target')!r}, not {target!r}")
    if not result.get("passed"):
        raise ValueError(f"{path}: validation did not pass (tau={result.get('tau')}, exact={result.get('exact_match')}); "
                         "pass --allow-unvalidated to export anyway")
    return result


def served_target(formats, meta: dict, target: str, out_path: Path) -> str:
    """What an engine must load as the base model next to this head: the original target, or for a head
    trained jointly with it (Medusa-2, joint MTP) the fine-tuned target this export writes beside it. A GGUF
    target is served as the file itself (vLLM reads GGUF), the weights the head was trained and validated on."""
    from draftsmith.targets import gguf
    joint_format = getattr(formats, "FINE_TUNED_TARGET_FORMAT", None)
    if joint_format and meta["draft_config"]["draftsmith"].get("joint"):
        return str(out_path.parent / joint_format)
    return str(gguf.local_file(target).resolve()) if gguf.is_gguf(target) else target


def _gguf_facts(target: str) -> dict:
    """For a GGUF target, what the model card says of it: the model the file was converted from (its
    metadata) and how an engine that serves GGUF files is pointed at it."""
    from draftsmith.targets import gguf
    if not gguf.is_gguf(target):
        return {}
    return {"gguf": {"file": str(gguf.local_file(target).resolve()), "source_model": gguf.source_model(gguf.metadata(target)),
                     "serve_target": gguf.serve_hint(target)}}


def _adapter_extras(adapter, **available) -> dict:
    """The optional settings an adapter takes (the served base model, the validated K)."""
    names = inspect.signature(adapter).parameters
    return {k: v for k, v in available.items() if k in names and v is not None}


def export_head(head: str, engine: str, out: str, dtype: str = "bf16", allow_unvalidated: bool = False) -> dict:
    """Write config.json + model.safetensors + README.md (model card) for `engine` into `out`."""
    head_path, out_path = Path(head), Path(out)
    tensors, meta = artifacts.load_checkpoint(head_path)
    formats = head_spec(meta.get("kind", "eagle3")).formats
    if engine not in formats.ADAPTERS:
        raise ValueError(f"--to {engine!r}: valid engines for a {meta.get('kind', 'eagle3')} head are {', '.join(formats.ADAPTERS)}")
    missing = [name for name in formats.REQUIRED if name not in tensors]
    if missing:
        raise artifacts.ArtifactError(f"{head_path}: checkpoint lacks {missing}; engines would silently skip them")
    non_finite = [name for name, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if non_finite:  # never, not even --allow-unvalidated: an engine would serve garbage drafts
        raise artifacts.ArtifactError(f"{head_path}: non-finite (NaN/inf) tensors {non_finite[:8]}; retrain the head")
    target = meta.get("target_id") or ""
    validation = None if allow_unvalidated else check_validated(head_path, target)
    economics = find_economics(head_path)
    depth = economics["best_k"] if economics else (validation or {}).get("tree", {}).get("depth")
    meta = meta | {"served_target": served_target(formats, meta, target, out_path)} | _gguf_facts(target)
    if economics:
        meta = meta | {"economics": economics}
    if validation:  # a fine-tuned target is written in the dtype its exactness was proven in
        meta = meta | {"validated_dtype": validation["dtype"].removeprefix("torch."), "validated_depth": depth}
    adapter = formats.ADAPTERS[engine]
    config, named = adapter(tensors, meta["draft_config"], dtype, target=target,
                            **_adapter_extras(adapter, served_target=meta["served_target"], speculative_tokens=depth))
    writer = getattr(formats, "WRITERS", {}).get(engine)  # a layout with files of its own (names, a whole model)
    with artifacts.atomic_path(out_path) as tmp:
        tmp.mkdir(parents=True)
        if config:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if writer is None:
            save_file(named, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            writer(tmp, named, meta | {"export_dtype": dtype}, head_path)
        (tmp / "README.md").write_text(formats.model_card(engine, meta, validation, str(out_path)))
        sidecar = check.record(meta, engine, validation, head_path, depth, dtype)
        (tmp / check.SIDECAR).write_text(json.dumps(sidecar, indent=2) + "\n")
        if out_path.exists():
            shutil.rmtree(out_path)
    return {"out": str(out_path), "tensors": len(named), "validated": validation is not None,
            "serve": formats.serve_command(engine, meta["served_target"], str(out_path), **({"depth": depth} if depth else {})),
            "economics": economics}
