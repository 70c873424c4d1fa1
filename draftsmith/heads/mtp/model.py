"""MTP modules (DeepSeek-V3 §2.2; ../REFERENCE part 2 §4), trained post hoc on a frozen target or
jointly with it (head.lora, train/joint.py). Module k, fed the previous depth's hidden state h and
the next token x:

    x = eh_proj(cat[enorm(embed(x)), hnorm(h)])     (2H -> H, no bias; [embedding, hidden] as the
                                                     engines' loaders concatenate: vLLM deepseek_mtp.py)
    h' = block(x)                                   (one decoder layer of the target's own family, at
                                                     layer index N + k: a DeepSeek-V3 target gets its
                                                     MLA + MoE block, a Llama target its own layer)
    logits = lm_head(shared_head.norm(h'))          (the target's frozen embedding and lm_head)

h for the first step is the target's final hidden state after its final norm: vLLM's DeepseekV2Model
returns `self.norm(hidden_states, residual)` and its MTP proposer feeds exactly that as
`previous_hidden_states`, which the module re-normalises with `hnorm` (tested in test_mtp.py). h'
(before shared_head.norm) is the next step's h. The embedding at sequence position 0 is zeroed,
as vLLM does. D modules (`head.num_layers`, default 1); step i uses module i % D (vLLM's
`spec_step_idx % num_mtp_layers`)."""
from __future__ import annotations

import torch
from torch import nn

from draftsmith.heads import family
from draftsmith.heads.base import DraftHead
from draftsmith.heads.mtp.loss import mtp_loss

DEFAULT_TTT_STEPS = 3     # the recursive objective (FastMTP-style); k = 1 is DeepSeek's own
DEFAULT_BETA = 0.6


def draft_config_from_target(target_config, num_modules: int = 1, variant: str = "posthoc") -> dict:
    """The target's own text config (so the block is the target's layer N) + num_nextn_predict_layers."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    config = {k: v for k, v in text.to_dict().items() if not k.startswith("_") and k not in ("auto_map", "transformers_version")}
    config.pop("layer_types", None)
    config.pop("mlp_layer_types", None)
    config.update(num_nextn_predict_layers=num_modules, tie_word_embeddings=False,
                  draftsmith={"kind": "mtp", "layer_ids": [], "feature": "final", "variant": variant, "joint": variant == "joint"})
    return config


def block_config(config: dict):
    """A family config whose layer indices N..N+D-1 exist (MoE vs dense and per-layer types follow the index)."""
    return with_mtp_layers(family.layer_config(config), config["num_hidden_layers"], config["num_nextn_predict_layers"])


def with_mtp_layers(cfg, num_layers: int, num_modules: int):
    """`cfg` with layers N..N+D-1 added; MTP blocks are full-attention layers (Qwen3-Next's among linear ones)."""
    cfg.num_hidden_layers = num_layers + num_modules
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types[:num_layers]) + ["full_attention"] * num_modules
    return cfg


def _rms_norm(cfg, size: int) -> nn.Module:
    return family.rms_norm(cfg, size)


class MTPModule(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        H = cfg.hidden_size
        self.enorm, self.hnorm = _rms_norm(cfg, H), _rms_norm(cfg, H)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = family.init_fresh(family.decoder_layer(cfg, layer_idx), cfg)
        self.shared_head_norm = _rms_norm(cfg, H)


class MTPHead(DraftHead):
    kind = "mtp"
    sequence_parallel = True
    FROZEN = ("embed_tokens", "lm_head", "rotary")

    def __init__(self, config: dict, ttt_steps: int = 1, beta: float = DEFAULT_BETA):
        super().__init__()
        self.config, self.ttt_steps, self.beta = config, ttt_steps, beta
        # vLLM zeroes the embedding at sequence position 0; SGLang, speculators and transformers' `generate(use_mtp=True)`
        # do not (set False to draft as they do)
        self.zero_first_embedding = True
        cfg = block_config(config)
        N, D = config["num_hidden_layers"], config["num_nextn_predict_layers"]
        self.num_modules = D
        self.modules_ = nn.ModuleList(MTPModule(cfg, N + k) for k in range(D))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = family.rotary_embedding(cfg)
        for frozen in (self.embed_tokens, self.lm_head):
            frozen.weight.requires_grad_(False)

    @classmethod
    def from_target(cls, target_config, head_cfg, layer_ids: list[int]) -> "MTPHead":
        variant = "joint" if head_cfg.lora is not None else "posthoc"
        config = draft_config_from_target(target_config, head_cfg.num_layers, variant)
        return cls(config, head_cfg.ttt_steps or DEFAULT_TTT_STEPS, DEFAULT_BETA if head_cfg.loss_decay is None else head_cfg.loss_decay)

    @classmethod
    def from_config(cls, config: dict) -> "MTPHead":
        return cls(config)

    def step(self, token_ids_BT, h_BTH, position_ids_BT, attend, module: int = 0):
        """One MTP step with module `module % D`: the next hidden state (before shared_head.norm)."""
        m = self.modules_[module % self.num_modules]
        emb = self.embed_tokens(token_ids_BT).to(h_BTH.dtype)
        if self.zero_first_embedding:
            emb = emb * (position_ids_BT != 0)[..., None]
        x = m.eh_proj(torch.cat([m.enorm(emb), m.hnorm(h_BTH)], dim=-1))
        cos, sin = self.rotary(x, position_ids_BT)
        return m.block(x, position_embeddings=(cos, sin), attend=attend)

    def logits(self, h_BTH, module: int = 0):
        return self.lm_head(self.modules_[module % self.num_modules].shared_head_norm(h_BTH))

    def to_target_ids(self, ids):
        return ids

    def loss(self, batch: dict):
        """Recursive soft CE over `ttt_steps` with normalised weights beta^i; see loss.py."""
        return mtp_loss(self, batch)
