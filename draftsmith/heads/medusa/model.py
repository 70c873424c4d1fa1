"""Medusa heads (Cai et al. 2024): K heads on the target's final hidden state f_t (after its final
norm); head k (0-based) predicts token t+2+k, the target's own lm_head predicts t+1.

    head_k(f) = lm_head_k(block_k(f)),   block_k = num_layers x [x + SiLU(W x + b)]

Each layer of a block has its own weights (the reference code's `[ResBlock] * n` shares one module
across layers; ../REFERENCE part 2 §1), zero-initialised (weight and bias), so every head starts as
the target's lm_head. `lm_heads.k` are the head's own vocabulary projections initialised from the
target's lm_head, or with `original_lm_head: true` every head reads through the target's frozen
lm_head (vLLM's option of that name). Tensor names are vLLM's: `blocks.{k}.layers.{l}.{weight,bias}`,
`lm_heads.{k}.weight`.

Medusa-2 (the target fine-tuned jointly with LoRA) is the same head; its config records the LoRA
settings under `draftsmith.lora` and the adapter travels next to the head (targets/lora.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.heads.base import DraftHead
from draftsmith.heads.medusa.loss import medusa_loss


class MedusaBlock(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))
        for layer in self.layers:  # identity at init
            nn.init.zeros_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def forward(self, x):
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


def draft_config_from_target(target_config, head_cfg) -> dict:
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    return {"model_type": "medusa", "hidden_size": text.hidden_size, "vocab_size": text.vocab_size,
            "medusa_num_heads": head_cfg.num_heads, "medusa_num_layers": head_cfg.num_layers,
            "medusa_fc_bias": True, "original_lm_head": head_cfg.shared_lm_head, "hidden_act": "silu",
            "draftsmith": {"kind": "medusa", "layer_ids": [], "feature": "final",
                           "variant": "medusa2" if head_cfg.lora is not None else "medusa1", "joint": head_cfg.lora is not None}}


class MedusaHead(DraftHead):
    kind = "medusa"
    FROZEN = ("lm_head.",)  # the target's lm_head, when the heads share it

    def __init__(self, config: dict, loss_decay: float = 0.8, init_from_target: bool = False):
        super().__init__()
        self.config, self.loss_decay = config, loss_decay
        H, V, K = config["hidden_size"], config["vocab_size"], config["medusa_num_heads"]
        self.num_heads = K
        self.blocks = nn.ModuleList(MedusaBlock(H, config["medusa_num_layers"], config.get("medusa_fc_bias", True))
                                    for _ in range(K))
        if config.get("original_lm_head"):
            self.lm_head = nn.Linear(H, V, bias=False)
            self.lm_head.weight.requires_grad_(False)
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(K))
        self._init_lm_heads = init_from_target  # the target's lm_head is copied once, into a fresh head only

    @classmethod
    def from_target(cls, target_config, head_cfg, layer_ids: list[int]) -> "MedusaHead":
        return cls(draft_config_from_target(target_config, head_cfg), 0.8 if head_cfg.loss_decay is None else head_cfg.loss_decay, init_from_target=True)

    @classmethod
    def from_config(cls, config: dict) -> "MedusaHead":
        return cls(config)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        self._init_lm_heads = False  # trained (or published) lm_heads are kept
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def load_target_weights(self, embed: torch.Tensor, lm_head: torch.Tensor | None) -> None:
        if lm_head is None:
            return
        with torch.no_grad():
            if self.config.get("original_lm_head"):
                self.lm_head.weight.copy_(lm_head.to(self.lm_head.weight.dtype))
            elif self._init_lm_heads:
                for head in self.lm_heads:
                    head.weight.copy_(lm_head.to(head.weight.dtype))
                self._init_lm_heads = False

    def head_logits(self, features_BTH: torch.Tensor) -> torch.Tensor:
        """[K, B, T, V]: head k's logits for token t+2+k at every position t."""
        return torch.stack([self.one_head_logits(k, features_BTH) for k in range(len(self.blocks))])

    def one_head_logits(self, k: int, features_BTH: torch.Tensor) -> torch.Tensor:
        """[B, T, V]: head k's logits."""
        projection = self.lm_head if self.config.get("original_lm_head") else self.lm_heads[k]
        return projection(self.blocks[k](features_BTH.to(projection.weight.dtype)))

    def loss(self, batch: dict):
        """Σ_k decay^k · soft CE against the target's distribution of token t+2+k; see loss.py."""
        return medusa_loss(self, batch)
