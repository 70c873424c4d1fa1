"""Load a head into our EAGLE-3 module from any of: a draftsmith checkpoint (head.json), or an
exported/published directory in SGLang/EAGLE, vLLM or speculators layout (config.json + weights).

Layer-id conventions on import: speculators and our vLLM exports carry input-to-layer ids (ours);
SGLang/EAGLE/SpecForge configs carry output-of-layer ids (ours - 1). A config without ids gets the
EAGLE-3 default [2, N//2, N-3] for the target's N layers."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith import artifacts
from draftsmith.heads.eagle3.model import Eagle3Head, draft_config_from_target

EXPORT_MARK = "draftsmith_export"


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    for file in sorted(directory.glob("*.bin")):
        tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    if not tensors:
        raise artifacts.ArtifactError(f"{directory}: no *.safetensors or *.bin weights")
    return tensors


def _normalize_names(tensors: dict) -> dict:
    """Accept `model.` prefixes, `layers.0.` for `midlayer.`, vLLM's draft_id_to_target_id."""
    out = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.")
        name = name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name
        name = "d2t" if name == "draft_id_to_target_id" else name
        out[name] = tensor
    return out


def _imported_config(config: dict, target_config) -> tuple[dict, list[int]]:
    """Our draft config dict and layer ids from an engine config."""
    num_layers = target_config.get_text_config().num_hidden_layers
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise ValueError(f"speculators_model_type={config['speculators_model_type']!r}: only eagle3 heads load here")
        layer = config["transformer_layer_config"]
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        convention = "vllm"
    else:
        layer = config
        eagle = config.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids"))
        convention = (config.get(EXPORT_MARK) or {}).get("layer_convention", "sglang")
    if ids is None:
        ids = [2, num_layers // 2, num_layers - 3]
    elif convention == "sglang":
        ids = [i + 1 for i in ids]
    ours = draft_config_from_target(target_config, config["draft_vocab_size"], ids, layer.get("intermediate_size"))
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta"):
        if layer.get(key) is not None:
            ours[key] = layer[key]
    ours["head_dim"] = layer.get("head_dim") or ours["hidden_size"] // ours["num_attention_heads"]
    ours["target_hidden_size"] = config.get("target_hidden_size") or ours["target_hidden_size"]
    return ours, ids


def load_head(path: str | Path, target_config, embed_weight: torch.Tensor | None = None) -> tuple[Eagle3Head, dict]:
    """(head in eval mode, metadata). The frozen embedding comes from the target when given."""
    path = Path(path)
    if (path / "head.json").exists():
        tensors, meta = artifacts.load_checkpoint(path)
        config = meta["draft_config"]
        meta = {**meta, "source_format": "draftsmith"}
    elif (path / "config.json").exists():
        raw = json.loads((path / "config.json").read_text())
        config, ids = _imported_config(raw, target_config)
        tensors = _normalize_names(_read_weights(path))
        meta = {"kind": "eagle3", "layer_ids": ids, "draft_config": config, "target_id": None,
                "source_format": "speculators" if "speculators_model_type" in raw else "sglang/vllm"}
    else:
        raise artifacts.ArtifactError(f"{path}: neither a draftsmith checkpoint (head.json) nor an exported head (config.json)")
    head = Eagle3Head(config)
    tensors = {k: v for k, v in tensors.items() if not k.startswith("embed_tokens")}
    if "t2d" not in tensors and "d2t" in tensors:  # vLLM/ModelOpt heads may ship d2t only
        t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
        t2d[tensors["d2t"] + torch.arange(len(tensors["d2t"]))] = True
        tensors["t2d"] = t2d
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not m.startswith(("embed_tokens", "rotary"))]
    if missing or unexpected:
        raise artifacts.ArtifactError(f"{path}: weights do not fit an EAGLE-3 head (missing {missing}, unexpected {unexpected})")
    if embed_weight is not None:
        head.load_target_embedding(embed_weight)
    return head.eval(), meta
