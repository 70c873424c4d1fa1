"""The layer EAGLE-style heads share (EAGLE-3, P-EAGLE): a Llama decoder layer whose first instance reads
[input_layernorm(embedding) ‖ hidden_norm(hidden)] (width 2H) and whose attention is delegated to an
`attend(q, k, v)` the caller supplies, so training patterns (training-time test, COD) and the runtime's KV
caches drive the very same weights. Tensor names are the engines': hidden_norm, input_layernorm,
post_attention_layernorm, self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj."""
from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from draftsmith.heads.base import full_attention_rope, target_value


def llama_config(cfg: dict) -> LlamaConfig:
    """transformers' LlamaConfig of a head's HF-style config dict (one layer: MLP and rotary sizes)."""
    rope = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if cfg.get("rope_scaling"):
        rope = {**cfg["rope_scaling"], "rope_theta": cfg["rope_theta"]}
        rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
    return LlamaConfig(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                       num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
                       head_dim=cfg["head_dim"], rms_norm_eps=cfg["rms_norm_eps"], hidden_act=cfg["hidden_act"],
                       max_position_embeddings=cfg["max_position_embeddings"], vocab_size=cfg["vocab_size"],
                       rope_parameters=rope, num_hidden_layers=1)


class EagleAttention(nn.Module):
    """q/k/v read an input `width` wide (2H for the first layer, H after); `attend` does the attention."""

    def __init__(self, cfg: dict, width: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg["hidden_size"], bias=False)

    def forward(self, x_BTW, cos, sin, attend):
        B, T, _ = x_BTW.shape
        q = self.q_proj(x_BTW).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BTW).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BTW).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out_BhTd = attend(q, k, v)
        return self.o_proj(out_BhTd.transpose(1, 2).reshape(B, T, -1))


class EagleLayer(nn.Module):
    """`reads_embedding`: the first layer (input [embedding ‖ hidden], residual the hidden); else a plain layer."""

    def __init__(self, cfg: dict, reads_embedding: bool = True):
        super().__init__()
        eps, H = cfg["rms_norm_eps"], cfg["hidden_size"]
        self.reads_embedding = reads_embedding
        if reads_embedding:
            self.hidden_norm = LlamaRMSNorm(H, eps)
        self.input_layernorm = LlamaRMSNorm(H, eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps)
        self.self_attn = EagleAttention(cfg, 2 * H if reads_embedding else H)
        self.mlp = LlamaMLP(llama_config(cfg))

    def forward(self, emb_BTH, h_BTH, cos, sin, attend):
        if self.reads_embedding:
            x = torch.cat([self.input_layernorm(emb_BTH), self.hidden_norm(h_BTH)], dim=-1)
        else:
            x = self.input_layernorm(h_BTH)
        h = h_BTH + self.self_attn(x, cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


DEFAULT_DRAFT_VOCAB = 32000  # EAGLE-3 and P-EAGLE heads' draft vocabulary where the recipe names none


def eagle_config_from_target(target_config, draft_vocab_size: int | None, layer_ids: list[int],
                             intermediate_size: int | None = None, num_layers: int = 1,
                             architectures: list[str] | None = None, **extra) -> dict:
    """An EAGLE-style head's HF-style config: Llama layers sized from the target, whatever its family (dense,
    windowed, hybrid or MoE); sizes a target names otherwise are read under their names, and the ones it
    lacks take Llama defaults, listed in `draftsmith.defaults`. `extra`: the kind's own keys."""
    t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    defaults: list[str] = []
    rope = full_attention_rope(t)
    rope_theta = rope.get("rope_theta")
    if rope_theta is None:
        rope_theta = target_value(t, "rope_theta", defaults)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    heads = t.num_attention_heads
    mlp = intermediate_size or getattr(t, "intermediate_size", None) or getattr(t, "ffn_dim", None) or 4 * t.hidden_size
    return {
        "architectures": architectures or ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": t.hidden_size, "target_hidden_size": t.hidden_size,
        "intermediate_size": mlp,
        "num_attention_heads": heads, "num_key_value_heads": getattr(t, "num_key_value_heads", None) or heads,
        "head_dim": getattr(t, "head_dim", None) or t.hidden_size // heads,
        "num_hidden_layers": num_layers, "rms_norm_eps": target_value(t, "rms_norm_eps", defaults),
        "hidden_act": "silu",  # the engines' Llama draft layer runs SiLU whatever the target's MLP does
        "max_position_embeddings": target_value(t, "max_position_embeddings", defaults),
        "rope_theta": rope_theta, "rope_scaling": scaling,
        "vocab_size": t.vocab_size, "draft_vocab_size": draft_vocab_size or DEFAULT_DRAFT_VOCAB, "tie_word_embeddings": False,
        **extra,
        "bos_token_id": getattr(t, "bos_token_id", None), "eos_token_id": getattr(t, "eos_token_id", None),
        "draftsmith": {"layer_ids": list(layer_ids), "layer_convention": "input-to-layer", "defaults": defaults,
                       "target_model_type": getattr(t, "model_type", None)},
    }
