"""Verification of a draft tree against the target's logits.

Greedy: the longest root-to-node path whose every token is the target's argmax after its parent,
plus the bonus token (the argmax after the last accepted node). Vectorized over the tree.

Sampling (lossless, target-only rejection for deterministic drafts): at the current node, with p the
target distribution processed exactly as the plain sampler processes it, try the children in order;
accept child x with probability p(x); on rejection set p(x)=0 and renormalize; if every child is
rejected (or there are none) draw the next token from what is left of p. The emitted token is
then distributed exactly as p, so the output follows the target distribution."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.heads.tree import Tree


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def processed_probs(logits_V: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), then renormalize. Used by plain sampling and
    by verification alike, so both sample from the very same distribution."""
    logits = logits_V.float() / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1])).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= cfg.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(-1, keepdim=True)


def sample_token(logits_V: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> torch.Tensor:
    if cfg.greedy:
        return logits_V.argmax(-1)
    return torch.multinomial(processed_probs(logits_V, cfg), 1, generator=gen).squeeze(-1)


def verify_greedy(tree: Tree, logits_NV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted node indices root first, bonus token)."""
    argmax = logits_NV.argmax(-1)
    parent = tree.parent_N.clamp(min=0)
    match = tree.tokens_N == argmax[parent]
    match[0] = True
    accepted = match.clone()
    for _ in range(len(tree) - 1):  # a bound known on the host: no read-back; extra rounds are no-ops
        accepted = match & accepted[parent]
    best = torch.argmax(accepted.long() * (tree.depth_N + 1))
    path = torch.nonzero(tree.mask_NN[best]).flatten()
    return path, argmax[best]


def verify_sampling(tree: Tree, logits_NV: torch.Tensor, cfg: SamplingConfig,
                    gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    node, path = 0, [0]
    while True:
        probs = processed_probs(logits_NV[node], cfg)
        chosen = None
        for child in tree.children(node):
            token = tree.tokens_N[child]
            coin = torch.rand((), generator=gen, device=probs.device)
            if coin < probs[token]:
                chosen = child
                break
            probs[token] = 0.0
            probs = probs / probs.sum()
        if chosen is None:
            bonus = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            return torch.tensor(path, device=logits_NV.device), bonus
        node = chosen
        path.append(node)


def verify(tree: Tree, logits_NV: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None = None):
    return verify_greedy(tree, logits_NV) if cfg.greedy else verify_sampling(tree, logits_NV, cfg, gen)
