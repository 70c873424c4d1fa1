"""The vocabulary loss every kind shares, in fp32, summed over masked positions, with top-k hits against the
teacher's argmax. `objective` (recipe `head.objective`) picks the per-position loss, p the teacher, q the draft:

- `soft_ce`: -Σ_v p_v log q_v (soft cross-entropy, the default);
- `lk_alpha`: -log a, a = Σ_v min(p_v, q_v), the probability that the draft's token is accepted (LK losses);
- `lk_lambda`: λ·KL(p‖q) + (1 - λ)(1 - a), λ = scale·exp(-rate·a) with a detached: KL leads while a is small,
  where 1 - a alone has vanishing gradients, and the acceptance term takes over as the draft improves.

Linear in the sequence length: positions go in blocks of at most `LOSS_BUDGET / (batch x vocabulary)`
and, when there is more than one block, each block is checkpointed, so no [T, V] logits tensor is
kept for backward. The teacher's probabilities are sliced per block (`probs[:, lo:hi]`): a tensor,
or a streamed teacher (train/batches.StreamedTeacher) that computes each slice from the target's
hidden states and lm_head when asked. Gradients are those of the whole-sequence loss."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

LOSS_BUDGET = 2 ** 25  # fp32 logit elements one position block may hold (128 MiB)


OBJECTIVES = ("soft_ce", "lk_alpha", "lk_lambda")


def position_loss(p, logq, objective: str = "soft_ce", lk_scale: float = 1.0, lk_rate: float = 1.0):
    """The per-position loss of draft log-probabilities `logq` against teacher probabilities `p` (last dim: vocabulary)."""
    if objective == "soft_ce":
        return -(p * logq).sum(-1)
    accept = torch.minimum(p, logq.exp()).sum(-1)
    if objective == "lk_alpha":
        return -torch.log(accept.clamp(min=1e-6))
    if objective == "lk_lambda":
        kl = (torch.special.xlogy(p, p) - p * logq).sum(-1)
        lam = lk_scale * torch.exp(-lk_rate * accept.detach())
        return lam * kl + (1 - lam) * (1 - accept)
    raise ValueError(f"head.objective={objective!r}: expected one of {list(OBJECTIVES)}")


def _block_sums(logits_fn, h_BCH, probs, lo: int, hi: int, mask_BC, argmax_BC, top_k: tuple[int, ...],
                objective: tuple = ("soft_ce", 1.0, 1.0)):
    logits = logits_fn(h_BCH).float()
    ce = position_loss(probs[:, lo:hi], torch.log_softmax(logits, dim=-1), *objective)
    with torch.no_grad():
        top = logits.argmax(-1, keepdim=True) if top_k == (1,) else torch.topk(logits, max(top_k), dim=-1).indices
        hit = top == argmax_BC[..., None]
        hits = torch.stack([(hit[..., :j].any(-1) & mask_BC).sum() for j in top_k])
    return (ce * mask_BC).sum(), hits


def soft_ce_sums(logits_fn, h_BnH, probs, offset: int, mask_Bn, argmax_Bn, top_k: tuple[int, ...] = (1,),
                 budget: int | None = None, objective: tuple = ("soft_ce", 1.0, 1.0)):
    """(Σ_masked loss, hits per k in top_k) for draft logits `logits_fn(h)` at positions 0..n-1
    against teacher `probs[:, offset + p]`. `probs` is any object sliced as `probs[:, lo:hi]`;
    `objective` is (name, lk_scale, lk_rate), a head's `objective` attribute."""
    B, n = h_BnH.shape[:2]
    vocab = probs.shape[-1]
    step = max(1, min(n, (budget or LOSS_BUDGET) // max(1, B * vocab)))
    if step >= n:
        return _block_sums(logits_fn, h_BnH, probs, offset, offset + n, mask_Bn, argmax_Bn, top_k, objective)
    ce_sum, hits = 0.0, 0
    for s in range(0, n, step):
        e = min(n, s + step)
        block_ce, block_hits = checkpoint(_block_sums, logits_fn, h_BnH[:, s:e], probs, offset + s, offset + e,
                                          mask_Bn[:, s:e], argmax_Bn[:, s:e], top_k, objective, use_reentrant=False)
        ce_sum, hits = ce_sum + block_ce, hits + block_hits
    return ce_sum, hits
