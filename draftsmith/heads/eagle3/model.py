"""EAGLE-3 draft head, built to the published layout so exported weights load in SGLang and vLLM.

    h0      = fc(cat(f_low, f_mid, f_high))                     (3·H_target -> H, no bias)
    x       = cat(input_layernorm(embed(tok)), hidden_norm(h))  (width 2H, attention input)
    h       = h + o_proj(attn(x)) ; h = h + mlp(post_attention_layernorm(h))
    logits  = lm_head(norm(h))                                  (draft vocabulary only)
    the un-normed h is the next step's hidden state.

EAGLE 3.1 options (config keys as SpecForge and vLLM read them): `fc_norm`, one RMSNorm per captured feature
before the concatenation (`fc_norm.{i}.weight`); `norm_output`, norm(h) is both the lm_head input and the
hidden state fed to the next step.

Tensor names: fc.weight, midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
hidden_norm, input_layernorm, post_attention_layernorm}.weight, norm.weight, lm_head.weight, d2t, t2d.
The target's embedding is held frozen and never saved.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from draftsmith.heads.base import DraftHead, target_value as _target_value
from draftsmith.heads.eagle3.loss import ttt_loss


def draft_config_from_target(target_config, draft_vocab_size: int, layer_ids: list[int],
                             intermediate_size: int | None = None, fc_norm: bool = False, norm_output: bool = False) -> dict:
    """The head's HF-style config: a Llama layer sized from the target, whatever its family (dense,
    windowed, hybrid or MoE); sizes a target names otherwise are read under their names, and the ones it
    lacks take Llama defaults, listed in `draftsmith.defaults`."""
    t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    defaults: list[str] = []
    rope = dict(getattr(t, "rope_parameters", None) or {})
    rope_theta = rope.get("rope_theta", getattr(t, "rope_theta", None))
    if rope_theta is None:
        rope_theta = _target_value(t, "rope_theta", defaults)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    heads = t.num_attention_heads
    mlp = intermediate_size or getattr(t, "intermediate_size", None) or getattr(t, "ffn_dim", None) or 4 * t.hidden_size
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": t.hidden_size, "target_hidden_size": t.hidden_size,
        "intermediate_size": mlp,
        "num_attention_heads": heads, "num_key_value_heads": getattr(t, "num_key_value_heads", None) or heads,
        "head_dim": getattr(t, "head_dim", None) or t.hidden_size // heads,
        "num_hidden_layers": 1, "rms_norm_eps": _target_value(t, "rms_norm_eps", defaults),
        "hidden_act": "silu",  # the engines' Llama draft layer runs SiLU whatever the target's MLP does
        "max_position_embeddings": _target_value(t, "max_position_embeddings", defaults),
        "rope_theta": rope_theta, "rope_scaling": scaling,
        "vocab_size": t.vocab_size, "draft_vocab_size": draft_vocab_size, "tie_word_embeddings": False,
        "fc_norm": bool(fc_norm), "norm_output": bool(norm_output),
        "bos_token_id": getattr(t, "bos_token_id", None), "eos_token_id": getattr(t, "eos_token_id", None),
        "draftsmith": {"layer_ids": list(layer_ids), "layer_convention": "input-to-layer", "defaults": defaults,
                       "target_model_type": getattr(t, "model_type", None)},
    }


def _llama_config(cfg: dict) -> LlamaConfig:
    rope = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if cfg.get("rope_scaling"):
        rope = {**cfg["rope_scaling"], "rope_theta": cfg["rope_theta"]}
        rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
    return LlamaConfig(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                       num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
                       head_dim=cfg["head_dim"], rms_norm_eps=cfg["rms_norm_eps"], hidden_act=cfg["hidden_act"],
                       max_position_embeddings=cfg["max_position_embeddings"], vocab_size=cfg["vocab_size"],
                       rope_parameters=rope, num_hidden_layers=1)


class Eagle3Attention(nn.Module):
    """q/k/v read the 2H-wide input; the actual attention is delegated to `attend`, so training
    (training-time-test pattern) and the runtime (KV cache + tree mask) share these weights."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        width = 2 * cfg["hidden_size"]
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


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        eps = cfg["rms_norm_eps"]
        self.hidden_norm = LlamaRMSNorm(cfg["hidden_size"], eps)
        self.input_layernorm = LlamaRMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg["hidden_size"], eps)
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = LlamaMLP(_llama_config(cfg))

    def forward(self, emb_BTH, h_BTH, cos, sin, attend):
        x = torch.cat([self.input_layernorm(emb_BTH), self.hidden_norm(h_BTH)], dim=-1)
        h = h_BTH + self.self_attn(x, cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


DEFAULT_TTT_STEPS = 7  # EAGLE and SpecForge unroll 7 steps


def default_layer_ids(num_target_layers: int) -> list[int]:
    """Low, mid and high features (input-to-layer ids), as every EAGLE-3 stack defaults."""
    return [2, num_target_layers // 2, num_target_layers - 3]


class Eagle3Head(DraftHead):
    """The EAGLE-3 head. `config` is the HF-style dict from `draft_config_from_target`."""
    kind = "eagle3"
    sequence_parallel = True

    def __init__(self, config: dict, ttt_steps: int = 7, loss_decay: float = 0.8):
        super().__init__()
        self.config, self.ttt_steps, self.loss_decay = config, ttt_steps, loss_decay
        H, V, Vd = config["hidden_size"], config["vocab_size"], config["draft_vocab_size"]
        num_aux = len(config["draftsmith"]["layer_ids"])
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(num_aux * config["target_hidden_size"], H, bias=False)
        self.fc_norm = nn.ModuleList([LlamaRMSNorm(config["target_hidden_size"], config["rms_norm_eps"])
                                      for _ in range(num_aux)]) if config.get("fc_norm") else None
        self.norm_output = bool(config.get("norm_output"))
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(H, config["rms_norm_eps"])
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.rotary = LlamaRotaryEmbedding(_llama_config(config))
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))

    @classmethod
    def from_target(cls, target_config, head_cfg, layer_ids: list[int]) -> "Eagle3Head":
        config = draft_config_from_target(target_config, head_cfg.draft_vocab_size, layer_ids, head_cfg.intermediate_size,
                                          head_cfg.fc_norm, head_cfg.norm_output)
        return cls(config, head_cfg.ttt_steps or DEFAULT_TTT_STEPS, 0.8 if head_cfg.loss_decay is None else head_cfg.loss_decay)

    @classmethod
    def from_config(cls, config: dict) -> "Eagle3Head":
        """From a checkpoint's or an imported layout's draft config (inference defaults)."""
        return cls(config)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def load_target_embedding(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight.to(self.embed_tokens.weight.dtype))

    def load_target_weights(self, embed: torch.Tensor, lm_head: torch.Tensor | None = None) -> None:
        """The frozen target weights this head reads: the embedding (its lm_head is its own)."""
        self.load_target_embedding(embed)

    def rope(self, x, position_ids_BT):
        return self.rotary(x, position_ids_BT)

    def project(self, aux_BTK):
        """The first hidden state from the concatenated target features: fc, after one norm per feature (fc_norm)."""
        aux_BTK = aux_BTK.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            parts = aux_BTK.chunk(len(self.fc_norm), dim=-1)
            aux_BTK = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(aux_BTK)

    def step(self, token_ids_BT, h_BTH, position_ids_BT, attend):
        """One draft step: returns the hidden state the next step reads (un-normed; normed with norm_output)."""
        emb = self.embed_tokens(token_ids_BT).to(h_BTH.dtype)
        cos, sin = self.rope(h_BTH, position_ids_BT)
        out = self.midlayer(emb, h_BTH, cos, sin, attend)
        return self.norm(out) if self.norm_output else out

    def logits(self, h_BTH):
        return self.lm_head(h_BTH if self.norm_output else self.norm(h_BTH))

    def to_target_ids(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]

    def loss(self, batch: dict):
        """Training-time test over `ttt_steps` unrolled steps; see loss.py."""
        return ttt_loss(self, batch)
