"""Verification of a draft tree against the target's logits.

Greedy: the longest root-to-node path whose every token is the target's argmax after its parent,
plus the bonus token (the argmax after the last accepted node). Vectorized over the tree.

Sampling (lossless, target-only rejection for deterministic drafts): at the current node, with p the
target distribution processed exactly as the plain sampler processes it, try the children in order;
accept child x with probability p(x); on rejection set p(x)=0 and renormalize; if every child is
rejected (or there are none) draw the next token from what is left of p. The emitted token is
then distributed exactly as p, so the output follows the target distribution.

Sampled drafts (a tree with proposals, e.g. Medusa heads' distributions q): children were drawn
from q without replacement, in child order. Accept child x with probability min(1, p(x)/q(x)); on
rejection p <- norm(max(p - q, 0)) and q <- q without x, renormalized (recursive rejection
sampling; lossless for any proposal, since each residual depends on q and p only).

Typical acceptance (Medusa's, `acceptance: typical`) accepts x when p(x) > min(eps, a*exp(-H(p)));
it is lossy (the output no longer follows p) and is reported as such, never used for pass/fail."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.heads.tree import Tree


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    acceptance: str = "exact"          # "typical": Medusa's lossy rule (posterior_threshold, posterior_alpha)
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

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
    """(accepted node indices root first, bonus token): `verify_greedy_rows` on a batch of one tree."""
    paths, counts, bonus = verify_greedy_rows(tree.tokens_N[None], tree.parent_N[None], tree.depth_N[None], tree.mask_NN[None],
                                              torch.tensor([len(tree)], device=tree.tokens_N.device), logits_NV[None])
    return paths[0, :int(counts[0])], bonus[0]


def verify_greedy_rows(tokens_BN: torch.Tensor, parent_BN: torch.Tensor, depth_BN: torch.Tensor, mask_BNN: torch.Tensor,
                       sizes_B: torch.Tensor, logits_BNV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify_greedy` for a batch of padded trees in one pass (row b's first sizes_B[b] nodes are its tree): (accepted
    node indices [B, A] root first, each row's left-aligned and its tail filled with other node indices, their counts
    [B], bonus tokens [B]). The same paths and tokens as `verify_greedy` row by row, without a host step per row."""
    B, N = tokens_BN.shape
    argmax = logits_BNV.argmax(-1)
    parent = parent_BN.clamp(min=0)
    nodes = torch.arange(N, device=tokens_BN.device)
    match = (tokens_BN == argmax.gather(1, parent)) & (nodes < sizes_B[:, None])
    match[:, 0] = True
    accepted = match.clone()
    for _ in range(N - 1):
        accepted = match & accepted.gather(1, parent)
    best = torch.argmax(accepted.long() * (depth_BN + 1), dim=1)
    on_path = mask_BNN[torch.arange(B, device=best.device), best]                       # [B, N]
    counts = on_path.sum(1)
    order = torch.sort(torch.where(on_path, nodes, nodes + N), dim=1).indices          # path nodes first, ascending
    return order[:, :int(counts.max())], counts, argmax.gather(1, best[:, None]).squeeze(1)


def verify_sampling_rows(tokens_BN: torch.Tensor, sizes_B: torch.Tensor, logits_BNV: torch.Tensor, cfg: SamplingConfig,
                         gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify_sampling` for a batch of padded chains of deterministic drafts in one pass (row b: its root, then
    sizes_B[b] - 1 drafts, node i the child of node i - 1; `pad_chains`, or plain decoding's roots alone): (accepted node
    indices [B, A] root first, their counts [B], bonus tokens [B]), as `verify_greedy_rows` returns them. Each row
    follows `verify_sampling`'s rule: draft i + 1 is accepted with probability p_i(x_{i+1}); at the first rejection the
    bonus is drawn from p_i without x_{i+1}, renormalised; with every draft accepted, from the last node's p. The coins
    are drawn for the whole batch at once, so the output follows the same distribution as row by row, though a seed
    gives other tokens."""
    B, N = tokens_BN.shape
    probs = processed_probs(logits_BNV, cfg)                                             # [B, N, V]
    nodes = torch.arange(N, device=tokens_BN.device)
    counts = torch.ones(B, dtype=torch.long, device=tokens_BN.device)
    if N > 1:
        p_next = probs[:, :-1].gather(-1, tokens_BN[:, 1:, None]).squeeze(-1)            # p_i(x_{i+1}) [B, N - 1]
        coins = torch.rand(B, N - 1, generator=gen, device=probs.device)
        accepted = (coins < p_next) & (nodes[1:] < sizes_B[:, None])
        counts += accepted.long().cumprod(1).sum(1)
    last = counts - 1                                                                    # the node the bonus follows
    rejected = counts < sizes_B                                                          # its child was drawn and refused
    refused = tokens_BN.gather(1, counts.clamp(max=N - 1)[:, None])                      # [B, 1]
    p = probs[torch.arange(B, device=probs.device), last]
    p = torch.where(rejected[:, None] & (torch.arange(p.shape[-1], device=p.device) == refused), 0.0, p)
    bonus = torch.multinomial(p / p.sum(-1, keepdim=True), 1, generator=gen).squeeze(-1)
    return nodes.expand(B, N)[:, :int(counts.max())], counts, bonus


def _try_children(tree: Tree, node: int, probs: torch.Tensor, gen) -> tuple[int | None, torch.Tensor]:
    """Rejection over `node`'s children in order: (accepted child or None, what is left of p)."""
    row = -1 if tree.proposal_RV is None else int(tree.child_proposal_N[node])
    proposal = tree.proposal_RV[row].float().clone() if row >= 0 else None
    for child in tree.children(node):
        token = tree.tokens_N[child]
        coin = torch.rand((), generator=gen, device=probs.device)
        if proposal is None:  # deterministic draft: accept with p(x)
            if coin < probs[token]:
                return child, probs
            probs[token] = 0.0
        else:
            q = proposal[token].clamp(min=1e-30)
            if coin * q < probs[token]:  # coin < min(1, p/q)
                return child, probs
            residual = (probs - proposal).clamp_(min=0.0)
            if residual.sum() > 0:  # zero only when p == q, where rejection has probability zero
                probs = residual
            proposal[token] = 0.0
            proposal = proposal / proposal.sum().clamp(min=1e-30)
        probs = probs / probs.sum()
    return None, probs


def verify_sampling(tree: Tree, logits_NV: torch.Tensor, cfg: SamplingConfig,
                    gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    node, path = 0, [0]
    while True:
        chosen, probs = _try_children(tree, node, processed_probs(logits_NV[node], cfg), gen)
        if chosen is None:
            bonus = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            return torch.tensor(path, device=logits_NV.device), bonus
        node = chosen
        path.append(node)


def verify_typical(tree: Tree, logits_NV: torch.Tensor, cfg: SamplingConfig,
                   gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa's typical acceptance (lossy): the longest path whose every token clears the
    entropy-dependent threshold under its parent's distribution; ties go to the likeliest path."""
    probs_NV = processed_probs(logits_NV, cfg)
    parent = tree.parent_N.clamp(min=0)
    p_parent = probs_NV[parent]
    entropy = -(p_parent * torch.log(p_parent.clamp(min=1e-30))).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, cfg.posterior_threshold), cfg.posterior_alpha * torch.exp(-entropy))
    token_p = p_parent.gather(-1, tree.tokens_N[:, None]).squeeze(-1)
    match = token_p > threshold
    match[0] = True
    accepted = match.clone()
    for _ in range(len(tree) - 1):
        accepted = match & accepted[parent]
    logp = torch.log(token_p.clamp(min=1e-30)).masked_fill(tree.depth_N == 0, 0.0)
    path_logp = (tree.mask_NN.float() * logp[None]).sum(-1)
    score = accepted.float() * (tree.depth_N.float() * 1e4 + path_logp - path_logp.min() + 1)
    best = int(torch.argmax(score))
    path = torch.nonzero(tree.mask_NN[best]).flatten()
    return path, torch.multinomial(probs_NV[best], 1, generator=gen).squeeze(-1)


def verify(tree: Tree, logits_NV: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None = None):
    if cfg.greedy:
        return verify_greedy(tree, logits_NV)
    if cfg.acceptance == "typical":
        return verify_typical(tree, logits_NV, cfg, gen)
    return verify_sampling(tree, logits_NV, cfg, gen)
