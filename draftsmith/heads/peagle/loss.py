"""P-EAGLE training: every depth of the parallel draft in one pass, with COD (conditional drop) sampling.

Element (a, d) is anchor a's slot d: d = 0 is EAGLE-3's first step at position a (token x_{a+1}, feature f_a);
d >= 1 is the placeholder [MASK, mask_hidden] at position a + d. Each predicts token a + d + 2: the teacher's
row a + d + 1 (the teacher at position p predicts token p + 1), over the draft vocabulary.

- Attention (every layer): (a, d) sees the depth-0 elements of anchors <= a and its own chain's slots 1..d, exactly
  what one drafting forward sees at inference (the committed context, then the placeholders in order).
- COD sampling: depth 0 keeps every position; depth d keeps int((n_valid - d)·max(r^d, r_min)) chains drawn among
  the survivors of depth d - 1 whose target exists (r = head.cod_ratio, r_min = head.cod_min_ratio), new every step.
- Loss: each depth's mean over its elements (soft cross-entropy, or the LK losses through `head.objective`),
  averaged over depths with weights decay^d (head.loss_decay; 1: every depth alike, as speculators).

Memory is linear in the sequence length: depth 0 is SDPA's causal kernel; a later depth's queries go in blocks
whose scores (queries x committed keys) stay under SCORE_BUDGET, each checkpointed when there are several; with
`train.activation_checkpointing` each depth's pass through the layers is recomputed in backward."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from draftsmith.heads.objective import soft_ce_sums
from draftsmith.heads.ttt import SCORE_BUDGET, query_block, shift_left


def _repeat(x, heads: int):
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _anchored(q_BhNd, k0, v0, chain_k, chain_v, anchors_BN):
    """Queries of chains anchored at `anchors` over depth-0 keys k <= anchor and their own chain's keys (one
    per earlier slot, and their own), one softmax in fp32."""
    heads, T = q_BhNd.shape[1], k0.shape[2]
    scale = 1.0 / math.sqrt(q_BhNd.shape[-1])
    scores = (q_BhNd @ _repeat(k0, heads).transpose(-1, -2)).float() * scale            # [B, h, N, T]
    seen = torch.arange(T, device=q_BhNd.device)[None, None, :] <= anchors_BN[:, :, None]
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    chain = torch.stack([(q_BhNd * _repeat(k, heads)).sum(-1).float() * scale for k in chain_k], dim=-1)
    weights = torch.softmax(torch.cat([scores, chain], dim=-1), dim=-1).to(q_BhNd.dtype)
    out = weights[..., :T] @ _repeat(v0, heads)
    for j, v in enumerate(chain_v):
        out = out + weights[..., T + j, None] * _repeat(v, heads)
    return out


def anchored_attention(q_BhNd, k0, v0, chain_k, chain_v, anchors_BN, budget: int | None = None):
    """`_anchored` over blocks of queries so that no block's scores exceed the budget (checkpointed when split)."""
    B, heads, N = q_BhNd.shape[:3]
    step = query_block(B * heads, N, k0.shape[2] + len(chain_k), budget or SCORE_BUDGET)
    if step >= N:
        return _anchored(q_BhNd, k0, v0, chain_k, chain_v, anchors_BN)
    blocks = [checkpoint(_anchored, q_BhNd[:, :, s:s + step], k0, v0, [k[:, :, s:s + step] for k in chain_k],
                         [v[:, :, s:s + step] for v in chain_v], anchors_BN[:, s:s + step], use_reentrant=False)
              for s in range(0, N, step)]
    return torch.cat(blocks, dim=2)


def cod_chains(valid_BT: torch.Tensor, depths: int, ratio: float, min_ratio: float) -> list[tuple]:
    """Per depth d = 1..depths-1: (anchors [B, n], parent [B, n] = index into depth d-1's list, ok [B, n]).
    Depth 0's list is every position 0..T-2, so at depth 1 the parent is the anchor itself."""
    B, T = valid_BT.shape
    device = valid_BT.device
    n_valid = valid_BT[:, 1:].sum(1).tolist()
    previous = [torch.arange(T - 1, device=device)] * B
    out = []
    for d in range(1, depths):
        anchors, parents = [], []
        for b in range(B):
            target = previous[b] + d + 1
            ok = target <= T - 1
            ok[ok.clone()] = valid_BT[b, target[ok]]
            candidates = torch.nonzero(ok).flatten()
            keep = min(len(candidates), max(0, int((n_valid[b] - d) * max(ratio ** d, min_ratio))))
            pick = torch.sort(candidates[torch.randperm(len(candidates), device=device)[:keep]]).values
            parents.append(pick)
            anchors.append(previous[b][pick])
        n = max(len(a) for a in anchors)
        if n == 0:
            break
        padded = lambda rows: torch.stack([F.pad(r, (0, n - len(r))) for r in rows])  # noqa: E731
        ok = torch.stack([torch.arange(n, device=device) < len(a) for a in anchors])
        out.append((padded(anchors), padded(parents), ok))
        previous = anchors
    return out


def _gather_slots(x_BkNd, index_BM):
    return x_BkNd.gather(2, index_BM[:, None, :, None].expand(-1, x_BkNd.shape[1], -1, x_BkNd.shape[-1]))


def _run(head, *args):
    """head.run, through activation checkpointing under train.activation_checkpointing (backward recomputes a depth)."""
    if head.checkpoint_steps and torch.is_grad_enabled():
        return checkpoint(head.run, *args, use_reentrant=False)
    return head.run(*args)


def cod_loss(head, batch: dict):
    """Returns (loss, metrics); batch as EAGLE-3's (input_ids, aux, position_ids, target_probs over the draft
    vocabulary, target_valid, target_argmax)."""
    ids, pos, valid, argmax = batch["input_ids"], batch["position_ids"], batch["target_valid"], batch["target_argmax"]
    probs = batch["target_probs"]
    B, T = ids.shape
    num_layers = len(head.layers)
    base = [None] * num_layers                        # depth-0 K/V per layer [B, kv, T, d]
    slots = [[] for _ in range(num_layers)]           # per layer, per depth >= 1: own K/V [B, kv, n_d, d]

    def causal(i):
        def attend(q, k, v):
            base[i] = (k, v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return attend

    h0 = _run(head, shift_left(ids, 1), head.project(batch["aux"]), pos, causal)
    count = valid[:, 1:].sum().clamp(min=1)
    ce, hits = soft_ce_sums(head.logits, h0[:, :T - 1], probs, 1, valid[:, 1:], argmax[:, 1:], objective=head.objective)
    losses, accs, counts = [ce / count], [hits[0].float() / count], [valid[:, 1:].sum()]
    index: list[torch.Tensor] = []                    # for the current depth: its chain's slot j's index in depth j's list
    batch_idx = torch.arange(B, device=ids.device)[:, None]
    for d, (anchors, parent, ok) in enumerate(cod_chains(valid, head.depths, head.cod_ratio, head.cod_min_ratio), start=1):
        index = [i.gather(1, parent) for i in index] + [parent] if d > 1 else []
        n = anchors.shape[1]

        def chained(i, anchors=anchors, index=index):
            def attend(q, k, v):
                del slots[i][d - 1:]
                slots[i].append((k, v))
                earlier = [(_gather_slots(kj, ix), _gather_slots(vj, ix)) for (kj, vj), ix in zip(slots[i][:d - 1], index)]
                return anchored_attention(q, *base[i], [e[0] for e in earlier] + [k], [e[1] for e in earlier] + [v], anchors)
            return attend

        tokens = torch.full((B, n), head.mask_token_id, dtype=torch.long, device=ids.device)
        hidden = head.mask_state().expand(B, n, -1)
        h = _run(head, tokens, hidden, pos.gather(1, anchors) + d, chained)
        rows = (anchors + d + 1).clamp(max=T - 1)
        ce, hits = soft_ce_sums(head.logits, h, probs[batch_idx, rows], 0, ok, argmax[batch_idx, rows], objective=head.objective)
        n_ok = ok.sum()
        losses.append(ce / n_ok.clamp(min=1))
        accs.append(hits[0].float() / n_ok.clamp(min=1))
        counts.append(n_ok)
    weights = [head.loss_decay ** d for d in range(len(losses))]
    total = sum(w * loss for w, loss in zip(weights, losses)) / sum(weights)
    metrics = {f"acc_{d}": acc.detach() for d, acc in enumerate(accs)}
    metrics.update({f"loss_{d}": loss.detach() for d, loss in enumerate(losses)})
    metrics["sim_accept_len"] = torch.cumprod(torch.stack(accs).detach(), 0).sum()
    metrics["num_positions"] = valid.sum().detach()
    metrics["num_chain_slots"] = torch.stack(counts[1:]).sum() if len(counts) > 1 else torch.zeros((), device=ids.device)
    metrics["loss"] = total.detach()
    return total, metrics
