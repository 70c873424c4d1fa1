"""Draft layers of the target's own family: the decoder-layer and rotary classes of the target's
transformers architecture (Llama, Qwen2/3, Mistral, DeepSeek-V3...), built from its config, so a
head has exactly the target's block (biases, q/k norms, MLA/MoE) and its engine layout.

The attention those layers run is delegated to the caller through transformers' public
`AttentionInterface`: the head passes `attend(q, k, v) -> out_BhTd` as a keyword argument, so the
training-time-test pattern (heads/ttt.py) and the drafter's KV cache + tree mask drive the very
same weights. RoPE, projections and norms stay the library's own code."""
from __future__ import annotations

import sys

import torch
from torch import nn
from transformers import AttentionInterface, AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

ATTENTION = "draftsmith_delegated"


def _delegated_attention(module, query, key, value, attention_mask, attend=None, **kwargs):
    """q_BhTd, k/v_BkTd after RoPE -> (out_BThd, no weights); `attend` comes from the head."""
    if attend is None:
        raise RuntimeError("a draft layer ran without an `attend` function (call it through its head)")
    return attend(query, key, value).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, _delegated_attention)


def layer_config(config: dict) -> PretrainedConfig:
    """A one-layer config of the target's family from a head's HF-style config dict."""
    keys = {k: v for k, v in config.items() if k not in ("draftsmith", "architectures", "model_type")}
    cfg = AutoConfig.for_model(config["model_type"], **keys)
    cfg.num_hidden_layers = 1
    cfg._attn_implementation = ATTENTION
    return cfg


def _family_class(config: PretrainedConfig, suffix: str) -> type:
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"model_type {config.model_type!r}: transformers has no causal LM for it")
    module = sys.modules[MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__module__]
    found = [v for k, v in vars(module).items() if k.endswith(suffix) and isinstance(v, type) and issubclass(v, nn.Module)
             and v.__module__ == module.__name__]
    if len(found) != 1:
        raise ValueError(f"model_type {config.model_type!r}: expected one *{suffix} class in {module.__name__}, "
                         f"found {[c.__name__ for c in found]}")
    return found[0]


def decoder_layer(config: PretrainedConfig, layer_idx: int = 0) -> nn.Module:
    """The family's decoder layer (its own class and weights layout)."""
    return _family_class(config, "DecoderLayer")(config, layer_idx)


@torch.no_grad()
def init_fresh(layer: nn.Module, config: PretrainedConfig) -> nn.Module:
    """Every parameter of a freshly built family layer set explicitly. Standalone, some families' layers
    leave weights as `torch.empty` (DeepSeek-V3's packed experts: NaN or ~1e35) and routers at zero,
    which their PreTrainedModel would have initialised. nn.Linear keeps its own init and norms their
    ones/zeros; every other parameter gets N(0, initializer_range) (matrices) or zeros (vectors)."""
    std = getattr(config, "initializer_range", 0.02)
    for module in layer.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) or "norm" in type(module).__name__.lower():
            continue
        for param in module.parameters(recurse=False):
            param.normal_(0.0, std) if param.dim() >= 2 else param.zero_()
    for name, buffer in layer.named_buffers():
        if buffer.is_floating_point() and not buffer.is_meta and not torch.isfinite(buffer).all():
            raise ValueError(f"{type(layer).__name__}.{name}: non-finite buffer in a fresh draft layer")
    return layer


def rotary_embedding(config: PretrainedConfig) -> nn.Module:
    """The family's rotary embedding: call as rotary(x, position_ids_BT) -> (cos, sin)."""
    return _family_class(config, "RotaryEmbedding")(config=config)


def rms_norm(config: PretrainedConfig, size: int) -> nn.Module:
    """The family's own RMSNorm (e.g. Qwen3-Next's zero-centred one), with the config's epsilon."""
    return _family_class(config, "RMSNorm")(size, eps=config.rms_norm_eps)


def kv_cache_dims(config: dict) -> tuple[int, int, int]:
    """(KV heads, key dim, value dim) of the family's attention as the delegated `attend` sees it:
    MLA (DeepSeek-V2/V3) expands to one K/V per query head, keys qk_nope + qk_rope wide."""
    if config.get("kv_lora_rank"):
        return (config["num_attention_heads"], config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["v_head_dim"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config.get("num_key_value_heads") or config["num_attention_heads"], head_dim, head_dim
