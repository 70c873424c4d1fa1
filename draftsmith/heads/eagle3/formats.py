"""EAGLE-3's engine formats: one export adapter per engine, each a pure function of
(tensors, draft config, dtype, target) -> (config.json dict, named tensors), and the import of
published or exported layouts (SGLang/EAGLE/SpecForge, vLLM, speculators) into our module.

Layer ids: ours are input-to-layer. SGLang adds one to its config ids, so its config gets ours-1;
vLLM and speculators use them verbatim. On import, speculators and our vLLM exports carry
input-to-layer ids; SGLang/EAGLE/SpecForge configs carry output-of-layer ids (ours - 1). A config
without ids gets the EAGLE-3 default [2, N//2, N-3] for the target's N layers."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.heads.eagle3.model import draft_config_from_target
from draftsmith.heads.hf_layout import (EXPORT_MARK, HF_LAYER_KEYS, card, cast, complete_vocab_maps, dtype_keys,
                                        measured_k, read_weights)

TITLE = "EAGLE-3 draft head"
REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")


def _eagle3_hf_config(config: dict, ids: list[int], dtype: str, engine: str) -> dict:
    out = {key: config[key] for key in HF_LAYER_KEYS if key in config}
    out.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", draft_vocab_size=config["draft_vocab_size"],
               target_hidden_size=config["target_hidden_size"], tie_word_embeddings=False, **dtype_keys(dtype),
               norm_before_residual=False, attention_bias=False, mlp_bias=False,
               fc_norm=bool(config.get("fc_norm")), norm_output=bool(config.get("norm_output")),
               eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
               **{EXPORT_MARK: {"engine": engine, "layer_convention": engine, "draftsmith_layer_ids": config["draftsmith"]["layer_ids"],
                                **_trained_range(config)}})
    return out


def _trained_range(config: dict) -> dict:
    """The longest sample it was trained on; RoPE (theta, scaling, max positions) is the target's, so an
    engine serves it over the target's whole context."""
    tokens = config["draftsmith"].get("trained_max_tokens")
    return {"trained_max_tokens": tokens} if tokens else {}


def to_sglang(tensors: dict, config: dict, dtype: str, target: str = "") -> tuple[dict, dict]:
    """SGLang `LlamaForCausalLMEagle3`: midlayer.* names, no embedding, config ids = ours - 1."""
    ids = [k - 1 for k in config["draftsmith"]["layer_ids"]]
    return _eagle3_hf_config(config, ids, dtype, "sglang"), cast(tensors, dtype)


def to_vllm(tensors: dict, config: dict, dtype: str, target: str = "") -> tuple[dict, dict]:
    """vLLM `Eagle3LlamaForCausalLM` reads the same files (it renames midlayer. and d2t itself);
    its aux ids are input-to-layer, so ours go in unchanged."""
    return _eagle3_hf_config(config, list(config["draftsmith"]["layer_ids"]), dtype, "vllm"), cast(tensors, dtype)


def to_speculators(tensors: dict, config: dict, dtype: str, target: str = "", speculative_tokens: int = 3) -> tuple[dict, dict]:
    """speculators `eagle3`: layers.0.* names, transformer_layer_config, speculators_config; the
    embedding is stored (read from the target's weights when it is a local directory), as
    speculators-built checkpoints do."""
    embed, verifier_architectures = _verifier(target)
    layer = {key: config[key] for key in HF_LAYER_KEYS if key in config}
    layer.update(model_type="llama", attention_bias=False, mlp_bias=False, num_hidden_layers=1)
    out = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.2.0",
           "draft_vocab_size": config["draft_vocab_size"], "target_hidden_size": config["target_hidden_size"],
           "norm_before_residual": False, "norm_before_fc": False, "fc_norm": bool(config.get("fc_norm")),
           "norm_output": bool(config.get("norm_output")),
           "embed_requires_grad": False, "eagle_aux_hidden_state_layer_ids": list(config["draftsmith"]["layer_ids"]),
           "transformer_layer_config": layer, **dtype_keys(dtype), "tie_word_embeddings": False,
           "speculators_config": {
               "algorithm": "eagle3", "default_proposal_method": "greedy",
               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                     "verifier_accept_k": 1, "accept_tolerance": 0.0}],
               "verifier": {"name_or_path": target, "architectures": verifier_architectures}},
           EXPORT_MARK: {"engine": "speculators", "layer_convention": "vllm"}}
    renamed = {k.replace("midlayer.", "layers.0.", 1): v for k, v in tensors.items()}
    if embed is not None:
        renamed["embed_tokens.weight"] = embed
    return out, cast(renamed, dtype)


ADAPTERS = {"sglang": to_sglang, "vllm": to_vllm, "speculators": to_speculators}


def serve_command(engine: str, target: str, out: str, depth: int = 3) -> str:
    if engine == "sglang":
        return (f"python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {out} --speculative-num-steps {depth} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {depth + 1}")
    if engine == "vllm":
        return (f"vllm serve {target} --speculative-config "
                f"'{{\"method\": \"eagle3\", \"model\": \"{out}\", \"num_speculative_tokens\": {depth}}}'")
    return f"vllm serve {out}"


def _verifier(target: str) -> tuple[torch.Tensor | None, list]:
    from draftsmith.targets.loading import load_target_embeddings
    if target and (Path(target) / "config.json").exists():
        embed, _ = load_target_embeddings(target)
        return embed, json.loads((Path(target) / "config.json").read_text()).get("architectures", [])
    return None, []


def model_card(engine: str, meta: dict, validation: dict | None, out: str) -> str:
    facts = [f"layer ids (input-to-layer): {meta.get('layer_ids')}",
             f"draft vocabulary: {meta['draft_config']['draft_vocab_size']}"]
    options = [k for k in ("fc_norm", "norm_output") if meta["draft_config"].get(k)]
    if options:
        facts.append(f"EAGLE 3.1 options: {', '.join(options)} (vLLM and SpecForge read these config keys)")
    return card(TITLE, engine, meta, validation, serve_command(engine, meta.get("served_target") or meta.get("target_id") or "<target>", out, depth=measured_k(meta, 3)), facts)


def _normalize_names(tensors: dict) -> dict:
    """Accept `model.` prefixes, `layers.0.` for `midlayer.`, vLLM's draft_id_to_target_id."""
    out = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.")
        name = name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name
        name = "d2t" if name == "draft_id_to_target_id" else name
        out[name] = tensor
    return out


def imported_config(config: dict, target_config) -> tuple[dict, list[int]]:
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
    ours = draft_config_from_target(target_config, config["draft_vocab_size"], ids, layer.get("intermediate_size"),
                                    bool(config.get("fc_norm")), bool(config.get("norm_output")))
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta"):
        if layer.get(key) is not None:
            ours[key] = layer[key]
    ours["head_dim"] = layer.get("head_dim") or ours["hidden_size"] // ours["num_attention_heads"]
    ours["target_hidden_size"] = config.get("target_hidden_size") or ours["target_hidden_size"]
    return ours, ids


def recognizes(config: dict) -> bool:
    """An EAGLE-3 layout: speculators eagle3, or an HF-style config with a draft vocabulary."""
    if "speculators_model_type" in config:
        return config["speculators_model_type"] == "eagle3"
    if config.get("parallel_drafting") or "PEagleDraftModel" in (config.get("architectures") or []):
        return False  # P-EAGLE's (heads/peagle)
    return "draft_vocab_size" in config or "Eagle3" in "".join(config.get("architectures") or [])


def import_layout(path: Path, raw: dict, target_config) -> tuple[dict, dict, dict]:
    """(our draft config, our tensor names, metadata) from an exported/published directory."""
    config, ids = imported_config(raw, target_config)
    tensors = _normalize_names(read_weights(path))
    complete_vocab_maps(tensors, config["vocab_size"])
    meta = {"kind": "eagle3", "layer_ids": ids, "draft_config": config, "target_id": None,
            "source_format": "speculators" if "speculators_model_type" in raw else "sglang/vllm"}
    return config, tensors, meta
