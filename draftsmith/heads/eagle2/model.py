"""EAGLE-2 draft head: the EAGLE-1 network (SafeAILab/EAGLE `cnets1.Model`), drafted in dynamic trees.

    x      = fc(cat(embed(x_{t+1}), f_t))          (2H -> H; bias from the recipe)
    h      = decoder_layer(x)                      (the target family's own layer, no input_layernorm)
    logits = lm_head(h)                            (the target's frozen lm_head, full vocabulary)

f_t is the target's final hidden state after its final norm (HF `hidden_states[-1]`), which is why
the first layer has no input norm; h predicts f_{t+1} and is the next step's feature. No final norm,
no own lm_head. Tensor names as published: fc.weight (+ fc.bias), layers.0.{self_attn,mlp,
post_attention_layernorm}.*; the target's embedding and lm_head are held frozen and never saved."""
from __future__ import annotations

import torch
from torch import nn

from draftsmith.heads import family
from draftsmith.heads.base import DraftHead, full_attention_rope
from draftsmith.heads.eagle2.loss import eagle2_loss

DEFAULT_TTT_STEPS = 1  # the published EAGLE-1 objective; BENCHMARKS.md measures k > 1
LLAMA2_VOCAB = 32000  # Llama-2/Vicuna: the published EAGLE heads for these targets have fc.bias


def default_fc_bias(text_config) -> bool:
    """As the target family's published heads: EAGLE's default (bias) for Llama-2-era targets,
    none for the others (the Llama-3 heads set `bias: false`; vLLM's loader has no fc bias)."""
    return text_config.model_type == "llama" and text_config.vocab_size == LLAMA2_VOCAB


ENGINE_FAMILIES = ("llama", "mistral", "qwen2")  # target families whose own layer an engine's EAGLE-1 class holds
LLAMA_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_theta", "rope_scaling",
                    "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
LAYERS = ("llama", "target")


def layer_family(target_family: str, layer: str | None) -> str:
    """The draft layer's family: `head.layer: target` is the target's own, `llama` a Llama layer (as the
    EAGLE reference builds for every target); None: the target's where an engine serves it, else Llama."""
    if layer not in (None, *LAYERS):
        raise ValueError(f"head.layer={layer!r}: expected one of {', '.join(LAYERS)}")
    if layer == "llama" or (layer is None and target_family not in ENGINE_FAMILIES):
        return "llama"
    return target_family


def _llama_layer_config(text) -> dict:
    """A Llama layer of the target's sizes (attention, MLP, RoPE, vocabulary); SiLU and no biases, as
    the engines' `LlamaDecoderLayer` builds it whatever the target's own block is."""
    from transformers import LlamaConfig
    source = text.to_dict()
    keys = {k: source[k] for k in LLAMA_LAYER_KEYS if source.get(k) is not None}
    keys["head_dim"] = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    keys["rope_parameters"] = full_attention_rope(text)  # one dict, a full-attention layer's (Gemma 3 holds one per type)
    return LlamaConfig(**keys, hidden_act="silu", attention_bias=False, mlp_bias=False).to_dict()


def draft_config_from_target(target_config, fc_bias: bool | None = None, intermediate_size: int | None = None,
                             layer: str | None = None) -> dict:
    """The head's HF-style config: one decoder layer, of the target's own family (its config with one
    layer, so the engines and `family.layer_config` rebuild exactly the target's block) or a Llama layer
    of the target's sizes (`layer`, see `layer_family`), plus `bias` for fc."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    family = layer_family(text.model_type, layer)
    source = text.to_dict() if family == text.model_type else _llama_layer_config(text)
    config = {k: v for k, v in source.items() if not k.startswith("_") and k not in ("auto_map", "transformers_version")}
    config.update(num_hidden_layers=1, tie_word_embeddings=False,
                  bias=default_fc_bias(text) if fc_bias is None else fc_bias,
                  draftsmith={"kind": "eagle2", "layer_ids": [], "feature": "final", "target_model_type": text.model_type})
    if intermediate_size:
        config["intermediate_size"] = intermediate_size
    config.pop("layer_types", None)  # per-layer lists of the full target: one layer here
    return config


class Eagle2Head(DraftHead):
    kind = "eagle2"
    sequence_parallel = True
    FROZEN = ("embed_tokens", "lm_head", "rotary")  # the target's embedding and lm_head

    def __init__(self, config: dict, ttt_steps: int = 1, loss_decay: float = 0.8, feature_weight: float = 1.0,
                 token_weight: float = 0.1, input_noise: float = 0.0):
        super().__init__()
        self.config, self.ttt_steps, self.loss_decay = config, ttt_steps, loss_decay
        self.feature_weight, self.token_weight, self.input_noise = feature_weight, token_weight, input_noise
        layer_config = family.layer_config(config)
        H, V = layer_config.hidden_size, layer_config.vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.fc = nn.Linear(2 * H, H, bias=bool(config.get("bias", False)))
        layer = family.init_fresh(family.decoder_layer(layer_config, 0), layer_config)
        layer.input_layernorm = nn.Identity()  # the feature arrives normed (target's final norm)
        self.layers = nn.ModuleList([layer])
        self.lm_head = nn.Linear(H, V, bias=False)
        self.rotary = family.rotary_embedding(layer_config)
        for frozen in (self.embed_tokens, self.lm_head):
            frozen.weight.requires_grad_(False)

    @classmethod
    def from_target(cls, target_config, head_cfg, layer_ids: list[int]) -> "Eagle2Head":
        config = draft_config_from_target(target_config, head_cfg.fc_bias, head_cfg.intermediate_size, head_cfg.layer)
        return cls(config, head_cfg.ttt_steps or DEFAULT_TTT_STEPS, 0.8 if head_cfg.loss_decay is None else head_cfg.loss_decay, head_cfg.feature_weight, head_cfg.token_weight,
                   head_cfg.input_noise)

    @classmethod
    def from_config(cls, config: dict) -> "Eagle2Head":
        return cls(config)

    def step(self, token_ids_BT, h_BTH, position_ids_BT, attend):
        """One draft step: the predicted next feature (also the next step's input)."""
        emb = self.embed_tokens(token_ids_BT).to(h_BTH.dtype)
        x = self.fc(torch.cat([emb, h_BTH], dim=-1))
        cos, sin = self.rotary(x, position_ids_BT)
        return self.layers[0](x, position_embeddings=(cos, sin), attend=attend)

    def logits(self, h_BTH):
        return self.lm_head(h_BTH)

    def to_target_ids(self, ids):
        return ids

    def loss(self, batch: dict):
        """Feature regression + 0.1 x soft CE, unrolled over `ttt_steps`; see loss.py."""
        return eagle2_loss(self, batch)
