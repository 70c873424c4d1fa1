"""What every head kind's module shares: the loss is the forward (DDP/FSDP/DeepSpeed hook into
forward), its config dict is what checkpoints and exports record, and the frozen target weights
it holds (`FROZEN` prefixes) are never saved."""
from __future__ import annotations

import torch
from torch import nn


class DraftHead(nn.Module):
    kind: str = ""
    FROZEN: tuple[str, ...] = ("embed_tokens", "rotary")
    config: dict
    checkpoint_steps: bool = False  # recompute each unrolled step in backward (train.activation_checkpointing)
    sequence_parallel: bool = False  # its loss computes a SequenceShard of a sample (heads/ttt.py)
    objective: tuple = ("soft_ce", 1.0, 1.0)  # the vocabulary loss (head.objective, lk_scale, lk_rate): heads/objective.py

    def loss(self, batch: dict):
        raise NotImplementedError

    def forward(self, batch: dict):
        return self.loss(batch)

    def draft_config(self) -> dict:
        return dict(self.config)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Heads drafting over the full target vocabulary (all but EAGLE-3): the map must be the identity."""
        assert len(d2t) == len(t2d) and not d2t.any(), f"{self.kind} heads use the full target vocabulary"

    def load_target_weights(self, embed: torch.Tensor, lm_head: torch.Tensor | None) -> None:
        """Copy the target's frozen embedding (and lm_head, for heads that read through it)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed.to(self.embed_tokens.weight.dtype))
            if lm_head is not None:
                self.lm_head.weight.copy_(lm_head.to(self.lm_head.weight.dtype))

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint keeps (the frozen target weights left out)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(self.FROZEN)}


class DraftVocabHead(DraftHead):
    """Heads whose lm_head covers a draft vocabulary (EAGLE-3, P-EAGLE): `d2t` maps a draft id to its target id
    (target = draft + d2t[draft]), `t2d` marks the target ids it holds; of the target they read only the embedding."""

    def add_vocab_maps(self, vocab_size: int, draft_vocab_size: int) -> None:
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    lm_head_from_target: bool = False  # head.lm_head_init: target

    def load_target_weights(self, embed: torch.Tensor, lm_head: torch.Tensor | None = None) -> None:
        """The target's embedding (frozen in EAGLE-3, the starting point of P-EAGLE's own); the lm_head is the
        head's, started from the target's rows of the draft vocabulary where `lm_head_from_target` is set."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed.to(self.embed_tokens.weight.dtype))
            if self.lm_head_from_target and lm_head is not None:
                rows = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t
                self.lm_head.weight.copy_(lm_head[rows.to(lm_head.device)].to(self.lm_head.weight.dtype))

    def to_target_ids(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]


# what a head built as a Llama layer reads from any target, under the names targets give it
LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "rope_theta": 10000.0}
ALIASES = {"rms_norm_eps": ("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon")}


def target_value(t, key: str, used_defaults: list[str]):
    """A Llama-layer size from a target config that may name it otherwise (Cohere's layer_norm_eps, LFM2's
    norm_eps...); the Llama default, recorded in `used_defaults`, where it names it nowhere."""
    for name in ALIASES.get(key, (key,)):
        value = getattr(t, name, None)
        if value is not None:
            return value
    used_defaults.append(key)
    return LLAMA_DEFAULTS[key]


def mask_token(t, explicit: int | None) -> tuple[int, str]:
    """(id, where it came from) of the mask token of heads that draft from placeholder slots (DFlash, P-EAGLE):
    `head.mask_token_id` when set, else the target's pad token, else its end-of-sequence token."""
    if explicit is not None:
        return int(explicit), "head.mask_token_id"
    pad, eos = getattr(t, "pad_token_id", None), getattr(t, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) else eos
    if pad is not None:
        return int(pad), "pad_token_id"
    if eos is not None:
        return int(eos), "eos_token_id"
    raise ValueError("head.mask_token_id: the target names no pad or eos token; set the mask token's id "
                     "(the tokenizer's <|MASK|> where it has one, else an unused embedding row)")


def full_attention_rope(t) -> dict:
    """The target's RoPE parameters for a full-attention layer, as transformers 5 holds them (`rope_parameters`, with
    `rope_theta`): one dict, or one per layer type (Gemma 3: local theta 10K on sliding layers, linear x8 scaling and
    theta 1M on full ones), of which a head built as a full-attention layer takes the full-attention entry."""
    rope = dict(getattr(t, "rope_parameters", None) or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))
    if rope.get("rope_theta") is None and getattr(t, "rope_theta", None) is not None:
        rope["rope_theta"] = t.rope_theta
    return rope
