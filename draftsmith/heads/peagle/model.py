"""P-EAGLE: EAGLE-3 that drafts K tokens in one forward, with a learned mask state for the positions it has not seen.

    h0      = fc(cat(f_low, f_mid, f_high))            a committed position (3·H_target -> H, no bias)
    h0      = fc(mask_hidden)                           a placeholder slot: the learned [1, 1, 3·H_target] feature
    layer 0 : x = cat(input_layernorm(embed(tok)), hidden_norm(h)) (2H), as EAGLE-3's; layers 1..N-1 plain Llama
    logits  = lm_head(norm(h))                          over the draft vocabulary (d2t maps to target ids)

Slot 0 of a round is EAGLE-3's first step (the committed token and its features); slots d = 1..K-1 are
[MASK token, mask_hidden] at positions a + d, each seeing the committed context and the slots before it: every
draft token of the round from one forward, no recurrence. The embedding is trained and saved (P-EAGLE's).

Tensor names (vLLM's multi-layer EAGLE-3, speculators' peagle): embed_tokens.weight, fc.weight, mask_hidden,
layers.0.{input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.*}, layers.k.*,
norm.weight, lm_head.weight, d2t, t2d."""
from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from draftsmith.heads.base import DraftVocabHead, mask_token
from draftsmith.heads.eagle_layer import EagleLayer, eagle_config_from_target, llama_config
from draftsmith.heads.peagle.loss import cod_loss

DEFAULT_DEPTHS = 8      # tokens trained per forward (speculators: 8 depths)
DEFAULT_LAYERS = 4      # the published heads' N


def default_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's low, mid and high features (input-to-layer ids)."""
    return [2, num_target_layers // 2, num_target_layers - 3]


def draft_config_from_target(target_config, draft_vocab_size: int, layer_ids: list[int], num_layers: int,
                             mask_token_id: int | None, intermediate_size: int | None = None) -> dict:
    """SpecForge's P-EAGLE config (`PEagleDraftModel`, N Llama layers, a draft vocabulary) plus the mask token."""
    t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    mask_id, source = mask_token(t, mask_token_id)
    config = eagle_config_from_target(target_config, draft_vocab_size, layer_ids, intermediate_size, num_layers,
                                      architectures=["PEagleDraftModel"], mask_token_id=mask_id, parallel_drafting=True)
    config["draftsmith"]["mask_token_source"] = source
    return config


class PEagleHead(DraftVocabHead):
    kind = "peagle"
    FROZEN = ("rotary",)  # the embedding is trained with the head

    def __init__(self, config: dict, depths: int = DEFAULT_DEPTHS, cod_ratio: float = 0.7, cod_min_ratio: float = 0.2,
                 loss_decay: float = 1.0):
        super().__init__()
        self.config, self.depths, self.cod_ratio, self.cod_min_ratio = config, depths, cod_ratio, cod_min_ratio
        self.loss_decay = loss_decay
        H, V, Vd = config["hidden_size"], config["vocab_size"], config["draft_vocab_size"]
        features = len(config["draftsmith"]["layer_ids"]) * config["target_hidden_size"]
        self.mask_token_id = config["mask_token_id"]
        self.embed_tokens = nn.Embedding(V, H)
        self.fc = nn.Linear(features, H, bias=False)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, features))
        self.layers = nn.ModuleList(EagleLayer(config, reads_embedding=i == 0) for i in range(config["num_hidden_layers"]))
        self.norm = LlamaRMSNorm(H, config["rms_norm_eps"])
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.rotary = LlamaRotaryEmbedding(llama_config(config))
        self.add_vocab_maps(V, Vd)

    @classmethod
    def from_target(cls, target_config, head_cfg, layer_ids: list[int]) -> "PEagleHead":
        config = draft_config_from_target(target_config, head_cfg.draft_vocab_size, layer_ids, head_cfg.num_layers,
                                          head_cfg.mask_token_id, head_cfg.intermediate_size)
        return cls(config, head_cfg.ttt_steps or DEFAULT_DEPTHS, head_cfg.cod_ratio, head_cfg.cod_min_ratio,
                   1.0 if head_cfg.loss_decay is None else head_cfg.loss_decay)

    @classmethod
    def from_config(cls, config: dict) -> "PEagleHead":
        return cls(config)

    def project(self, features_BTK):
        return self.fc(features_BTK.to(self.fc.weight.dtype))

    def mask_state(self):
        """[1, 1, H]: fc(mask_hidden), the hidden state every placeholder slot starts from."""
        return self.fc(self.mask_hidden.to(self.fc.weight.dtype))

    def run(self, tokens_BT, h_BTH, positions_BT, attend_for):
        """The N layers over rows [tokens, first hidden] at `positions`; `attend_for(i)` is layer i's attention."""
        emb = self.embed_tokens(tokens_BT).to(h_BTH.dtype)
        cos, sin = self.rotary(h_BTH, positions_BT)
        for i, layer in enumerate(self.layers):
            h_BTH = layer(emb, h_BTH, cos, sin, attend_for(i))
        return h_BTH

    def logits(self, h_BTH):
        return self.lm_head(self.norm(h_BTH))

    def loss(self, batch: dict):
        return cod_loss(self, batch)
