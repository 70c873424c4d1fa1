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
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from draftsmith.heads.base import DraftVocabHead
from draftsmith.heads.eagle_layer import EagleLayer, eagle_config_from_target, llama_config
from draftsmith.heads.eagle3.loss import ttt_loss


def draft_config_from_target(target_config, draft_vocab_size: int, layer_ids: list[int],
                             intermediate_size: int | None = None, fc_norm: bool = False, norm_output: bool = False) -> dict:
    """The head's HF-style config: a Llama layer sized from the target, whatever its family (dense,
    windowed, hybrid or MoE); sizes a target names otherwise are read under their names, and the ones it
    lacks take Llama defaults, listed in `draftsmith.defaults`."""
    return eagle_config_from_target(target_config, draft_vocab_size, layer_ids, intermediate_size,
                                    architectures=["LlamaForCausalLMEagle3"], fc_norm=bool(fc_norm),
                                    norm_output=bool(norm_output))


DEFAULT_TTT_STEPS = 7  # EAGLE and SpecForge unroll 7 steps


def default_layer_ids(num_target_layers: int) -> list[int]:
    """Low, mid and high features (input-to-layer ids), as every EAGLE-3 stack defaults."""
    return [2, num_target_layers // 2, num_target_layers - 3]


class Eagle3Head(DraftVocabHead):
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
        self.midlayer = EagleLayer(config)
        self.norm = LlamaRMSNorm(H, config["rms_norm_eps"])
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.rotary = LlamaRotaryEmbedding(llama_config(config))
        self.add_vocab_maps(V, Vd)

    @classmethod
    def from_target(cls, target_config, head_cfg, layer_ids: list[int]) -> "Eagle3Head":
        config = draft_config_from_target(target_config, head_cfg.draft_vocab_size, layer_ids, head_cfg.intermediate_size,
                                          head_cfg.fc_norm, head_cfg.norm_output)
        return cls(config, head_cfg.ttt_steps or DEFAULT_TTT_STEPS, 0.8 if head_cfg.loss_decay is None else head_cfg.loss_decay)

    @classmethod
    def from_config(cls, config: dict) -> "Eagle3Head":
        """From a checkpoint's or an imported layout's draft config (inference defaults)."""
        return cls(config)

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

    def loss(self, batch: dict):
        """Training-time test over `ttt_steps` unrolled steps; see loss.py."""
        return ttt_loss(self, batch)
