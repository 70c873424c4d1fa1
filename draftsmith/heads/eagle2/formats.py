"""EAGLE-2's engine formats (the EAGLE-1 layout): export adapters for SGLang (`--speculative-algorithm
EAGLE`) and vLLM (`"method": "eagle"`), and import of published EAGLE-1 heads (yuhuili layout).

Tensors: `fc.weight` [H, 2H] (+ `fc.bias`), `layers.0.{self_attn,mlp}.*` and
`layers.0.post_attention_layernorm.weight` (no input_layernorm), in the target family's own names;
the embedding and lm_head are the target's and are not written. Facts from the engines' loaders:
- SGLang `LlamaForCausalLMEagle` (models/llama_eagle.py): fc is built with a bias, always; so the
  export always writes `fc.bias` (zeros for a head trained without one) to load exactly.
  `Qwen2ForCausalLMEagle` serves Qwen2-family heads. SGLang builds the class `architectures` names,
  whatever the target: the draft layer's family decides, so a Llama draft layer (`head.layer: llama`)
  serves a Qwen3, Gemma or Phi target.
- vLLM `EagleLlamaForCausalLM` (models/llama_eagle.py): fc has no bias; layers.0 without input norm;
  `embed_tokens` optional (shared with the target). vLLM's EAGLEConfig maps the draft config's
  `LlamaForCausalLM` to `EagleLlamaForCausalLM` itself (older versions prepend `Eagle`
  unconditionally), so the config names the plain Llama architecture. Llama-family only."""
from __future__ import annotations

import torch

from draftsmith.heads.eagle2.model import draft_config_from_target
from draftsmith.heads.hf_layout import EXPORT_MARK, NotServable, card, cast, dtype_keys, measured_k, read_weights

TITLE = "EAGLE-2 draft head"
REQUIRED = ("fc.weight", "layers.0.post_attention_layernorm.weight")
SGLANG_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle", "mistral": "LlamaForCausalLMEagle",
                        "qwen2": "Qwen2ForCausalLMEagle"}
VLLM_FAMILIES = ("llama", "mistral")
PUBLISHED_ARCHITECTURES = {"LlamaForCausalLM", "LlamaForCausalLMEagle", "Qwen2ForCausalLMEagle",
                           "EagleLlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


def _hf_config(config: dict, dtype: str, engine: str, architecture: str, model_type: str) -> dict:
    """The draft layer's config as the engine reads it. No `bias` key: SGLang's and vLLM's Llama attention
    take `attention_bias or bias`, so `bias: true` would give q/k/v/o biases the checkpoint lacks (SGLang
    allocates them uninitialised); SGLang's EAGLE fc has a bias whatever the config says, vLLM's none."""
    out = {k: v for k, v in config.items() if k not in ("draftsmith", "bias", "dtype", "torch_dtype")}
    rope = dict(config.get("rope_parameters") or {})  # the engines read the legacy keys
    out["rope_theta"] = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    out["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    layer = "target" if config["model_type"] == config["draftsmith"].get("target_model_type", config["model_type"]) else "llama"
    out.update(architectures=[architecture], model_type=model_type, num_hidden_layers=1,
               tie_word_embeddings=False, **dtype_keys(dtype),
               **{EXPORT_MARK: {"engine": engine, "kind": "eagle2", "layer": layer,
                                "target_model_type": config["draftsmith"].get("target_model_type", config["model_type"])}})
    return out


def to_sglang(tensors: dict, config: dict, dtype: str, target: str = "") -> tuple[dict, dict]:
    family = config["model_type"]  # the draft layer's family (head.layer)
    if family not in SGLANG_ARCHITECTURES:
        raise NotServable(f"SGLang's EAGLE-1/2 classes hold {sorted(SGLANG_ARCHITECTURES)} draft layers, and this head's "
                          f"layer is {family!r}: train with head.layer=llama (served for any target), or validate and "
                          "serve this head in draftsmith's runtime")
    named = dict(tensors)
    if "fc.bias" not in named:  # SGLang's fc always has a bias: zeros are the head trained without one
        named["fc.bias"] = torch.zeros(named["fc.weight"].shape[0], dtype=named["fc.weight"].dtype)
    return _hf_config(config, dtype, "sglang", SGLANG_ARCHITECTURES[family], family), cast(named, dtype)


def to_vllm(tensors: dict, config: dict, dtype: str, target: str = "") -> tuple[dict, dict]:
    if config["model_type"] not in VLLM_FAMILIES:
        raise NotServable(f"vLLM's EAGLE-1/2 drafter (EagleLlamaForCausalLM) holds a Llama layer, and this head's layer is "
                          f"{config['model_type']!r}: train with head.layer=llama (served for any target), export "
                          "--to sglang, or serve in draftsmith's runtime")
    if "fc.bias" in tensors and tensors["fc.bias"].abs().max() > 0:
        raise NotServable("vLLM's EAGLE fc has no bias, and this head was trained with one: retrain with "
                          "head.fc_bias=false for vLLM, or export --to sglang")
    named = {k: v for k, v in tensors.items() if k != "fc.bias"}
    return _hf_config(config, dtype, "vllm", "LlamaForCausalLM", "llama"), cast(named, dtype)


ADAPTERS = {"sglang": to_sglang, "vllm": to_vllm}


def serve_command(engine: str, target: str, out: str, depth: int = 5, top_k: int = 8, num_nodes: int = 32) -> str:
    if engine == "sglang":
        return (f"python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE "
                f"--speculative-draft-model-path {out} --speculative-num-steps {depth} "
                f"--speculative-eagle-topk {top_k} --speculative-num-draft-tokens {num_nodes}")
    return (f"vllm serve {target} --speculative-config "
            f"'{{\"method\": \"eagle\", \"model\": \"{out}\", \"num_speculative_tokens\": {depth}}}'")


def model_card(engine: str, meta: dict, validation: dict | None, out: str) -> str:
    config = meta["draft_config"]
    target_family = config["draftsmith"].get("target_model_type", config["model_type"])
    facts = ["feature: the target's final hidden state (after its final norm); full vocabulary through the "
             "target's lm_head", f"fc bias: {bool(config.get('bias'))}; decoder layer: a {config['model_type']} layer "
             f"without input_layernorm (target family: {target_family})"]
    return card(TITLE, engine, meta, validation, serve_command(engine, meta.get("served_target") or meta.get("target_id") or "<target>", out, depth=measured_k(meta, 5)), facts)


def recognizes(config: dict) -> bool:
    """An EAGLE-1 layout: one-layer HF config, no draft vocabulary, no speculators/EAGLE-3 marks;
    or vLLM v0's wrapper {model_type: eagle, model: {...}}."""
    if config.get("model_type") == "eagle" and isinstance(config.get("model"), dict):
        return True
    if "speculators_model_type" in config or "draft_vocab_size" in config:
        return False
    mark = config.get(EXPORT_MARK) or {}
    architectures = set(config.get("architectures") or [])
    return mark.get("kind") == "eagle2" or (config.get("num_hidden_layers") == 1 and bool(architectures & PUBLISHED_ARCHITECTURES))


def _our_names(tensors: dict) -> dict:
    """`model.` prefixes dropped; the embedding and lm_head (the target's) left out."""
    out = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.")
        if not name.startswith(("embed_tokens", "lm_head")):
            out[name] = tensor
    return out


def _layer_choice(layer: dict, mark: dict, target_family: str) -> str:
    """Which draft layer a directory holds: our exports say so; a published head is a Llama layer when its
    config says llama for a target of another family, else the target's own."""
    if mark.get("layer"):
        return mark["layer"]
    return "llama" if layer.get("model_type") == "llama" and target_family != "llama" else "target"


def import_layout(path, raw: dict, target_config) -> tuple[dict, dict, dict]:
    """(our draft config, tensors, metadata) from an exported or published EAGLE-1 directory. The draft
    layer is the target's family or a Llama layer (see `_layer_choice`); sizes the published config
    states are checked against the target."""
    layer = raw["model"] if raw.get("model_type") == "eagle" else raw
    tensors = _our_names(read_weights(path))
    bias = "fc.bias" in tensors and bool(tensors["fc.bias"].abs().max() > 0)
    if "fc.bias" in tensors and not bias:
        del tensors["fc.bias"]  # our SGLang exports write zeros for a head without one
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    choice = _layer_choice(layer, raw.get(EXPORT_MARK) or {}, text.model_type)
    config = draft_config_from_target(target_config, fc_bias=bias, intermediate_size=layer.get("intermediate_size"),
                                      layer=choice)
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        if layer.get(key) is not None and layer[key] != config.get(key):
            raise ValueError(f"{path}/config.json: {key}={layer[key]} but the target has {config.get(key)}; "
                             "this head was trained for another target")
    meta = {"kind": "eagle2", "layer_ids": [], "draft_config": config, "target_id": None,
            "source_format": (raw.get(EXPORT_MARK) or {}).get("engine", "eagle1")}
    return config, tensors, meta
