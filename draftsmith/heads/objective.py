"""The vocabulary loss every kind shares: soft cross-entropy of the draft's distribution against the
teacher's, in fp32, summed over masked positions, with top-k hits against the teacher's argmax.

Linear in the sequence length: positions go in blocks of at most `LOSS_BUDGET / (batch x vocabulary)`
and, when there is more than one block, each block is checkpointed, so no [T, V] logits tensor is
kept for backward. The teacher's probabilities are sliced per block (`probs[:, lo:hi]`): a tensor,
or a streamed teacher (train/batches.StreamedTeacher) that computes each slice from the target's
hidden states and lm_head when asked. Gradients are those of the whole-sequence loss."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

LOSS_BUDGET = 2 ** 25  # fp32 logit elements one position block may hold (128 MiB)


def _block_sums(logits_fn, h_BCH, probs, lo: int, hi: int, mask_BC, argmax_BC, top_k: tuple[int, ...]):
    logits = logits_fn(h_BCH).float()
    ce = -(probs[:, lo:hi] * torch.log_softmax(logits, dim=-1)).sum(-1)
    with torch.no_grad():
        top = logits.argmax(-1, keepdim=True) if top_k == (1,) else torch.topk(logits, max(top_k), dim=-1).indices
        hit = top == argmax_BC[..., None]
        hits = torch.stack([(hit[..., :j].any(-1) & mask_BC).sum() for j in top_k])
    return (ce * mask_BC).sum(), hits


def soft_ce_sums(logits_fn, h_BnH, probs, offset: int, mask_Bn, argmax_Bn, top_k: tuple[int, ...] = (1,),
                 budget: int | None = None):
    """(Σ_masked soft CE, hits per k in top_k) for draft logits `logits_fn(h)` at positions 0..n-1
    against teacher `probs[:, offset + p]`. `probs` is any object sliced as `probs[:, lo:hi]`."""
    B, n = h_BnH.shape[:2]
    vocab = probs.shape[-1]
    step = max(1, min(n, (budget or LOSS_BUDGET) // max(1, B * vocab)))
    if step >= n:
        return _block_sums(logits_fn, h_BnH, probs, offset, offset + n, mask_Bn, argmax_Bn, top_k)
    ce_sum, hits = 0.0, 0
    for s in range(0, n, step):
        e = min(n, s + step)
        block_ce, block_hits = checkpoint(_block_sums, logits_fn, h_BnH[:, s:e], probs, offset + s, offset + e,
                                          mask_Bn[:, s:e], argmax_Bn[:, s:e], top_k, use_reentrant=False)
        ce_sum, hits = ce_sum + block_ce, hits + block_hits
    return ce_sum, hits
