"""P-EAGLE's engine formats.

- `vllm`: the EAGLE-3 layout vLLM's `eagle3` method reads with `"parallel_drafting": true` in the speculative
  config: `LlamaForCausalLMEagle3`, `num_hidden_layers` N (layer 0 reads [embedding ‖ hidden], layers 1.. are
  plain), input-to-layer aux ids in `eagle_config`, `mask_token_id` (where vLLM looks it up), `mask_hidden` (it
  projects it through `fc` once at load), the trained `embed_tokens.weight` (present, so not shared with the
  target), a draft vocabulary with `d2t`/`t2d`.
- `speculators`: `speculators_model_type: "peagle"`, `PEagleSpeculator` (speculators' EAGLE-3 config plus
  `mask_token_id`, `embed_requires_grad: true`); vLLM turns it into `eagle3` with parallel drafting.
Import reads both back, and SpecForge's `PEagleDraftModel` configs (output-of-layer ids, as its EAGLE-3's)."""
from __future__ import annotations

from pathlib import Path

from draftsmith.heads.hf_layout import (EXPORT_MARK, HF_LAYER_KEYS, card, cast, complete_vocab_maps, dtype_keys,
                                        measured_k, read_weights)
from draftsmith.heads.peagle.model import draft_config_from_target

TITLE = "P-EAGLE parallel draft head"
REQUIRED = ("embed_tokens.weight", "fc.weight", "mask_hidden", "norm.weight", "lm_head.weight", "d2t", "t2d")


def to_vllm(tensors: dict, config: dict, dtype: str, target: str = "") -> tuple[dict, dict]:
    out = {key: config[key] for key in HF_LAYER_KEYS if key in config}
    ids = list(config["draftsmith"]["layer_ids"])
    out.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", draft_vocab_size=config["draft_vocab_size"],
               target_hidden_size=config["target_hidden_size"], tie_word_embeddings=False, attention_bias=False,
               mlp_bias=False, norm_before_residual=False, parallel_drafting=True, mask_token_id=config["mask_token_id"],
               eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}, **dtype_keys(dtype),
               **{EXPORT_MARK: {"engine": "vllm", "layer_convention": "vllm", "draftsmith_layer_ids": ids,
                                "mask_token_source": config["draftsmith"].get("mask_token_source")}})
    return out, cast(tensors, dtype)


def to_speculators(tensors: dict, config: dict, dtype: str, target: str = "", speculative_tokens: int = 7) -> tuple[dict, dict]:
    layer = {key: config[key] for key in HF_LAYER_KEYS if key in config}
    layer.update(model_type="llama", attention_bias=False, mlp_bias=False)
    return {"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle", "speculators_version": "0.2.0",
            "draft_vocab_size": config["draft_vocab_size"], "target_hidden_size": config["target_hidden_size"],
            "norm_before_residual": False, "norm_before_fc": False, "embed_requires_grad": True,
            "mask_token_id": config["mask_token_id"],
            "eagle_aux_hidden_state_layer_ids": list(config["draftsmith"]["layer_ids"]),
            "transformer_layer_config": layer, **dtype_keys(dtype), "tie_word_embeddings": False,
            "speculators_config": {
                "algorithm": "peagle", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": target, "architectures": []}},
            EXPORT_MARK: {"engine": "speculators", "layer_convention": "vllm"}}, cast(tensors, dtype)


ADAPTERS = {"vllm": to_vllm, "speculators": to_speculators}


def serve_command(engine: str, target: str, out: str, depth: int = 7) -> str:
    if engine == "vllm":
        return (f"vllm serve {target} --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{out}\", "
                f"\"num_speculative_tokens\": {depth}, \"parallel_drafting\": true}}'")
    return f"vllm serve {out}"


def model_card(engine: str, meta: dict, validation: dict | None, out: str) -> str:
    draft = meta["draft_config"]
    facts = [f"layer ids (input-to-layer): {meta.get('layer_ids')}", f"draft vocabulary: {draft['draft_vocab_size']}",
             f"{draft['num_hidden_layers']} layers, mask token id {draft['mask_token_id']} "
             f"({draft['draftsmith'].get('mask_token_source')}); every draft token of a round from one forward"]
    return card(TITLE, engine, meta, validation, serve_command(engine, meta.get("served_target") or meta.get("target_id") or "<target>", out,
                                                               measured_k(meta, 7)), facts)


def recognizes(config: dict) -> bool:
    if "speculators_model_type" in config:
        return config["speculators_model_type"] == "peagle"
    return bool(config.get("parallel_drafting")) or "PEagleDraftModel" in (config.get("architectures") or [])


def import_layout(path: Path, raw: dict, target_config) -> tuple[dict, dict, dict]:
    """(our draft config, our tensor names, metadata) from a vLLM, speculators or SpecForge P-EAGLE directory."""
    num_target_layers = target_config.get_text_config().num_hidden_layers
    layer = raw.get("transformer_layer_config") or raw
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm_ids = "speculators_model_type" in raw or (raw.get(EXPORT_MARK) or {}).get("layer_convention") == "vllm"
    if ids is None:
        ids = [2, num_target_layers // 2, num_target_layers - 3]
    elif not vllm_ids:  # SpecForge: output-of-layer
        ids = [i + 1 for i in ids]
    mask = raw.get("mask_token_id", (raw.get("dflash_config") or {}).get("mask_token_id"))
    config = draft_config_from_target(target_config, raw["draft_vocab_size"], ids, layer["num_hidden_layers"], mask,
                                      layer.get("intermediate_size"))
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta"):
        if layer.get(key) is not None:
            config[key] = layer[key]
    config["target_hidden_size"] = raw.get("target_hidden_size") or config["target_hidden_size"]
    tensors = {}
    for name, tensor in read_weights(path).items():
        name = name.removeprefix("model.").replace("midlayer.", "layers.0.", 1)
        tensors["d2t" if name == "draft_id_to_target_id" else name] = tensor
    complete_vocab_maps(tensors, config["vocab_size"])
    meta = {"kind": "peagle", "layer_ids": ids, "draft_config": config, "target_id": None,
            "source_format": "speculators" if "speculators_model_type" in raw else "vllm/specforge"}
    return config, tensors, meta
