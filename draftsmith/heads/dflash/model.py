"""DFlash: a block-diffusion drafter that drafts a whole block in one forward, conditioned on the target's features.

    ctx     = hidden_norm(fc(cat(f_1 .. f_n)))               one context row per committed position (n·H_t -> H)
    block   = embed([x_p, MASK, ..., MASK])                  B rows at positions p .. p+B-1 (the target's embedding)
    layer l:  x = input_layernorm(h)
              K, V = k_norm(k_proj([ctx ; x])), v_proj([ctx ; x])   the context injected as keys and values
              h = h + o_proj(attn(q_norm(q_proj(x)), K, V)) ; h = h + mlp(post_attention_layernorm(h))
    logits  = lm_head(norm(h))                               slots 1..B-1: the draft (the target's lm_head)

With `draft_vocab_size` below the target's vocabulary (speculators' DFlash option) lm_head holds the target's
lm_head rows of the draft vocabulary's tokens (frozen, saved with the head since no engine derives them), `d2t` maps
a draft id to its target id (target = draft + d2t[draft]) and `t2d` marks the target ids it holds, as EAGLE-3's.

A block query sees every context row strictly before its anchor and its whole block, both ways (the anchor's own
feature is not known when drafting). Layers are Qwen3's (per-head q_norm/k_norm, GQA, RoPE at absolute positions,
SwiGLU). Tensor names are the z-lab layout's: fc, hidden_norm, norm, layers.{i}.{input_layernorm,
post_attention_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q_norm,k_norm}, mlp.{gate,up,down}_proj}. The
target's embedding and lm_head are frozen, shared and never saved.

Layer ids: ours are input-to-layer (HF hidden_states[k]); the z-lab `target_layer_ids` are output-of-layer (ours - 1)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from draftsmith.heads.base import DraftHead, DraftVocabHead, full_attention_rope, mask_token, target_value as _target_value
from draftsmith.heads.dflash.loss import dflash_loss

DEFAULT_BLOCK_SIZE = 16
DEFAULT_FEATURES = 5


def default_layer_ids(num_target_layers: int, n: int = DEFAULT_FEATURES) -> list[int]:
    """z-lab's default over an L-layer target, n features: [L // 2] for one, else round(1 + i·(L - 4)/(n - 1));
    returned input-to-layer (z-lab id + 1). Qwen3-8B (36 layers): z-lab [1, 9, 17, 25, 33], ours [2, 10, 18, 26, 34]."""
    L = num_target_layers
    n = max(1, min(n, L - 2))
    ids = [L // 2] if n == 1 else [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]
    return sorted({i + 1 for i in ids})


def default_gamma(block_size: int) -> float:
    """The decay of the per-slot loss weights exp(-(k - 1)/gamma): 7 with blocks of 16 (SpecForge), 4 with 8."""
    return 7.0 if block_size >= 16 else 4.0


def draft_layer_types(num_layers: int, sliding_window: int | None, layer_types: list[str] | None) -> list[str]:
    """Each draft layer's attention: `head.layer_types`, else with `head.sliding_window` every layer but the last
    sliding (as z-lab's Qwen3.6-27B draft), else all full."""
    if layer_types is None:
        layer_types = ["full_attention"] * num_layers if not sliding_window else \
            ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
    if len(layer_types) != num_layers or not set(layer_types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"head.layer_types={layer_types}: expected {num_layers} entries (head.num_layers), each "
                         "full_attention or sliding_attention")
    if "sliding_attention" in layer_types and not sliding_window:
        raise ValueError("head.layer_types has sliding_attention layers: set head.sliding_window (their context window)")
    return list(layer_types)


def draft_config_from_target(target_config, layer_ids: list[int], num_layers: int, block_size: int,
                             mask_token_id: int | None, intermediate_size: int | None = None,
                             sliding_window: int | None = None, layer_types: list[str] | None = None,
                             draft_vocab_size: int | None = None) -> dict:
    """The z-lab-style config: a Qwen3 stack at the target's hidden size, the block size, the mask token; with
    sliding layers, `layer_types`, `sliding_window` and `use_sliding_window` as z-lab writes them; with a draft
    vocabulary smaller than the target's, `draft_vocab_size` (vLLM's DFlash reads it, as speculators')."""
    t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    if draft_vocab_size is not None and not 0 < draft_vocab_size <= t.vocab_size:
        raise ValueError(f"head.draft_vocab_size={draft_vocab_size}: expected 1 to the target's vocabulary size "
                         f"({t.vocab_size}), or unset to draft over the whole vocabulary")
    defaults: list[str] = []
    rope_theta = full_attention_rope(t).get("rope_theta") or _target_value(t, "rope_theta", defaults)
    heads = t.num_attention_heads
    mask_token_id, mask_source = mask_token(t, mask_token_id)
    types = draft_layer_types(num_layers, sliding_window, layer_types)
    window = sliding_window if "sliding_attention" in types else None
    swa = {"use_swa": True, "swa_window_size": window} if window else {}
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": t.hidden_size, "target_hidden_size": t.hidden_size,
        "intermediate_size": intermediate_size or getattr(t, "intermediate_size", None) or 4 * t.hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": heads,
        "num_key_value_heads": getattr(t, "num_key_value_heads", None) or heads,
        "head_dim": getattr(t, "head_dim", None) or t.hidden_size // heads,
        "rms_norm_eps": _target_value(t, "rms_norm_eps", defaults), "hidden_act": "silu",
        "max_position_embeddings": _target_value(t, "max_position_embeddings", defaults),
        "rope_theta": rope_theta, "vocab_size": t.vocab_size, "tie_word_embeddings": False,
        **({"draft_vocab_size": draft_vocab_size} if draft_vocab_size and draft_vocab_size < t.vocab_size else {}),
        "layer_types": types, "sliding_window": window, "use_sliding_window": bool(window), "block_size": block_size,
        "num_target_layers": t.num_hidden_layers,
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": [k - 1 for k in layer_ids], **swa},
        "draftsmith": {"layer_ids": list(layer_ids), "layer_convention": "input-to-layer", "defaults": defaults,
                       "mask_token_source": mask_source, "target_model_type": getattr(t, "model_type", None)},
    }


def _llama_config(cfg: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                       num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
                       head_dim=cfg["head_dim"], rms_norm_eps=cfg["rms_norm_eps"], hidden_act="silu",
                       max_position_embeddings=cfg["max_position_embeddings"], vocab_size=cfg["vocab_size"],
                       rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]}, num_hidden_layers=1)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        H, self.heads, self.kv_heads, self.head_dim = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.q_proj = nn.Linear(H, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, H, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, cfg["rms_norm_eps"])
        self.k_norm = LlamaRMSNorm(self.head_dim, cfg["rms_norm_eps"])

    def _unrotated_keys_values(self, x_BTH):
        B, T, _ = x_BTH.shape
        k = self.k_norm(self.k_proj(x_BTH).view(B, T, self.kv_heads, self.head_dim)).transpose(1, 2)
        return k, self.v_proj(x_BTH).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)

    def keys_values(self, x_BTH, cos, sin):
        """K (normed, rotated) and V [B, kv, T, d] of rows x at the positions cos/sin were built for."""
        k, v = self._unrotated_keys_values(x_BTH)
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def forward(self, x_BNH, cos, sin, ctx_k, ctx_v, allowed_BNL, scratch: int | None = None, new_ctx=None):
        """Block rows x attend to [context keys ; their own keys] under `allowed` [B, N, S + N] (None: every key
        visible). With `scratch` (drafting) ctx_k/ctx_v are cache views with room after their first `scratch`
        slots: the block's K/V are written there and the keys read in place, without copying the context.
        `new_ctx` (drafting): (rows [B, P, H], store) context rows committed since the last block, projected to
        K/V in the block's own projections (cos/sin cover their P positions, then the block's) and handed to
        `store(k, v)` to write into the cache before the block reads it."""
        B, N, _ = x_BNH.shape
        q = self.q_norm(self.q_proj(x_BNH).view(B, N, self.heads, self.head_dim)).transpose(1, 2)
        if new_ctx is None:
            k, v = self._unrotated_keys_values(x_BNH)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        else:
            rows, store = new_ctx
            P = rows.shape[1]
            k, v = self.keys_values(torch.cat([rows, x_BNH], dim=1), cos, sin)
            q, _ = apply_rotary_pos_emb(q, q, cos[:, P:], sin[:, P:])
            store(k[:, :, :P], v[:, :, :P])
            k, v = k[:, :, P:], v[:, :, P:]
        if scratch is None:
            k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        else:
            ctx_k[:, :, scratch:scratch + N], ctx_v[:, :, scratch:scratch + N] = k, v
            k, v = ctx_k[:, :, :scratch + N], ctx_v[:, :, :scratch + N]
        mask = None if allowed_BNL is None else allowed_BNL[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                               enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, N, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = LlamaRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = DFlashAttention(cfg)
        self.mlp = LlamaMLP(_llama_config(cfg))

    def forward(self, h_BNH, cos, sin, ctx_k, ctx_v, allowed_BNL, scratch: int | None = None, new_ctx=None):
        h = h_BNH + self.self_attn(self.input_layernorm(h_BNH), cos, sin, ctx_k, ctx_v, allowed_BNL, scratch, new_ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashHead(DraftVocabHead):
    kind = "dflash"
    FROZEN = ("embed_tokens", "lm_head", "rotary")

    def __init__(self, config: dict, num_anchors: int = 512, gamma: float | None = None, dpace_alpha: float | None = None):
        super().__init__()
        self.config, self.num_anchors, self.dpace_alpha = config, num_anchors, dpace_alpha
        self.block_size = config["block_size"]
        self.gamma = gamma or default_gamma(self.block_size)
        self.mask_token_id = config["dflash_config"]["mask_token_id"]
        H, V = config["hidden_size"], config["vocab_size"]
        num_features = len(config["draftsmith"]["layer_ids"])
        self.fc = nn.Linear(num_features * config["target_hidden_size"], H, bias=False)
        self.hidden_norm = LlamaRMSNorm(H, config["rms_norm_eps"])
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config["num_hidden_layers"]))
        self.norm = LlamaRMSNorm(H, config["rms_norm_eps"])
        self.embed_tokens = nn.Embedding(V, H)
        self.draft_vocab = config.get("draft_vocab_size") or V
        self.lm_head = nn.Linear(H, self.draft_vocab, bias=False)
        for frozen in (self.embed_tokens, self.lm_head):
            frozen.weight.requires_grad_(False)
        self.rotary = LlamaRotaryEmbedding(_llama_config(config))
        self.vocab_maps = self.draft_vocab < V  # a draft vocabulary: d2t/t2d and the lm_head rows it keeps
        if self.vocab_maps:
            self.add_vocab_maps(V, self.draft_vocab)

    @classmethod
    def from_target(cls, target_config, head_cfg, layer_ids: list[int]) -> "DFlashHead":
        block = head_cfg.block_size or DEFAULT_BLOCK_SIZE
        config = draft_config_from_target(target_config, layer_ids, head_cfg.num_layers, block, head_cfg.mask_token_id,
                                          head_cfg.intermediate_size, head_cfg.sliding_window, head_cfg.layer_types,
                                          head_cfg.draft_vocab_size)
        return cls(config, head_cfg.num_anchors, head_cfg.loss_gamma, head_cfg.dpace_alpha)

    @classmethod
    def from_config(cls, config: dict) -> "DFlashHead":
        return cls(config)

    def context(self, features_BTK):
        """The context rows the layers read as keys and values: hidden_norm(fc(features))."""
        return self.hidden_norm(self.fc(features_BTK.to(self.fc.weight.dtype)))

    def context_kv(self, ctx_BSH, positions_BS):
        """Every layer's context K and V [B, kv, S, d]; the context does not flow through the layers."""
        cos, sin = self.rotary(ctx_BSH, positions_BS)
        return [layer.self_attn.keys_values(ctx_BSH, cos, sin) for layer in self.layers]

    def layer_types(self) -> list[str]:
        return self.config.get("layer_types") or ["full_attention"] * len(self.layers)

    def block_hidden(self, tokens_BN, positions_BN, kv: list, allowed, scratch: int | None = None, new_ctx=None):
        """The blocks' final hidden states (before norm) given every layer's context K/V; `allowed` [B, N, S + N],
        or one such mask per layer type (sliding layers: the context within the window, the block causal). With
        `scratch` = S, kv are cache views whose slots S.. take the block's K/V (drafting). `new_ctx` (drafting):
        (ctx [B, P, H], positions [B, P], store) context rows not yet in the cache, whose K/V every layer computes
        with the block's (one forward per round, as the reference drafts) and hands to store(layer, k, v)."""
        h = self.embed_tokens(tokens_BN).to(self.fc.weight.dtype)
        if new_ctx is not None:
            rows, rows_positions, store = new_ctx
            positions_BN = torch.cat([rows_positions, positions_BN], dim=1)
        cos, sin = self.rotary(h, positions_BN)
        for i, (layer, kind, (ctx_k, ctx_v)) in enumerate(zip(self.layers, self.layer_types(), kv)):
            extra = None if new_ctx is None else (rows, lambda k, v, i=i: store(i, k, v))
            h = layer(h, cos, sin, ctx_k, ctx_v, allowed[kind] if isinstance(allowed, dict) else allowed, scratch, extra)
        return h

    def logits(self, h_BNH):
        return self.lm_head(self.norm(h_BNH))

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if self.vocab_maps:
            super().set_vocab(d2t, t2d)
        else:
            DraftHead.set_vocab(self, d2t, t2d)

    def load_target_weights(self, embed: torch.Tensor, lm_head: torch.Tensor | None = None) -> None:
        """The target's embedding, and its lm_head: whole, or the rows of the draft vocabulary's tokens (`set_vocab` first)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed.to(self.embed_tokens.weight.dtype))
            if lm_head is not None:
                rows = lm_head[self.to_target_ids(torch.arange(self.draft_vocab, device=self.d2t.device)).to(lm_head.device)] \
                    if self.vocab_maps else lm_head
                self.lm_head.weight.copy_(rows.to(self.lm_head.weight.dtype))

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps: with a draft vocabulary its lm_head rows too (frozen, but no engine derives them)."""
        state = super().trainable_state()
        if self.vocab_maps:
            state["lm_head.weight"] = self.lm_head.weight
        return state

    def to_target_ids(self, ids):
        return super().to_target_ids(ids) if self.vocab_maps else ids

    def loss(self, batch: dict):
        return dflash_loss(self, batch)
