"""Load a head from a draftsmith checkpoint (head.json: its kind says which module) or from an
exported/published directory (config.json + weights: the kind whose formats module recognizes the
config imports it). Dispatch goes through the registry; nothing here knows a kind. Used by
`validate` (runtime) and by training from a published head (`head.init_from`)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith import artifacts
from draftsmith.heads.registry import head_spec, spec_for_layout


def load_head(path: str | Path, target_config, embed_weight: torch.Tensor | None = None,
              lm_head_weight: torch.Tensor | None = None):
    """(head in eval mode, metadata). The frozen target weights (embedding; lm_head for heads that
    read through it) come from the target when given."""
    path = Path(path)
    if (path / "head.json").exists():
        tensors, meta = artifacts.load_checkpoint(path)
        spec = head_spec(meta.get("kind", "eagle3"))
        config = meta["draft_config"]
        meta = {**meta, "source_format": "draftsmith"}
    elif (path / "config.json").exists():
        raw = json.loads((path / "config.json").read_text())
        spec = spec_for_layout(raw, str(path))
        config, tensors, meta = spec.formats.import_layout(path, raw, target_config)
    else:
        raise artifacts.ArtifactError(f"{path}: neither a draftsmith checkpoint (head.json) nor an exported head (config.json)")
    head = spec.model.from_config(config)
    saved = set(head.trainable_state())  # frozen target weights (embedding, lm_head) are never in a head's files
    tensors = {k: v for k, v in tensors.items() if k in saved or not k.startswith(head.FROZEN + ("embed_tokens",))}
    if embed_weight is not None:  # the target's frozen weights first: a head that trains its own embedding overrides it
        head.load_target_weights(embed_weight, lm_head_weight)
    try:
        missing, unexpected = head.load_state_dict(tensors, strict=False)
    except RuntimeError as exc:  # shapes that do not fit the config
        raise artifacts.ArtifactError(f"{path}: weights do not fit a {spec.kind} head for this target "
                                      f"({str(exc).splitlines()[-1].strip()})") from None
    missing = [m for m in missing if m in saved]
    if missing or unexpected:
        raise artifacts.ArtifactError(f"{path}: weights do not fit a {spec.kind} head (missing {missing}, unexpected {unexpected})")
    return head.eval(), meta
