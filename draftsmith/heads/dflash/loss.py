"""DFlash training: random anchors per sequence, one block per anchor, all blocks against the sample's context.

- Anchors: up to `num_anchors` positions p per sequence (1 <= p <= T - 2) whose next token carries loss
  (`target_valid[p]`), drawn at random every step. Anchor p's block is [x_p, MASK x (B - 1)] at positions p..p+B-1.
- Mask: a block query sees the context rows c < p (strictly: the anchor's own feature is not known when drafting)
  and every row of its own block, both ways; other blocks are hidden.
- Labels: slot k (1 <= k < B) predicts the token at p + k: the teacher's distribution at position p + k - 1,
  through `head.objective` (soft cross-entropy by default, or an LK loss). Slot 0 carries no loss.
- Weights: w_k = exp(-(k - 1)/gamma), the loss normalised by the weight of the positions that count; or, with
  `head.dpace_alpha` a, D-PACE's: q_i = exp(-CE_i), q~_i = (1 - a)·q_i + a, C_j = prod_{i<=j} q~_i,
  w_j = sum_{m>=j} C_m per block, detached (a slot weighs as much as the chance that drafting reaches it and beyond).

Anchors go in groups sized so that one group's attention scores stay under SCORE_BUDGET; with several groups each
is checkpointed (the context's K/V are computed once and shared)."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from draftsmith.heads.objective import position_loss

SCORE_BUDGET = 2 ** 24


def block_mask(anchors_BA: torch.Tensor, anchor_ok_BA: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """[B, A·Bs, S + A·Bs] visibility: context c < p_a, and the anchor's own block both ways."""
    B, A = anchors_BA.shape
    N = A * block_size
    owner = torch.arange(N, device=anchors_BA.device) // block_size                       # [N]
    p = anchors_BA[:, owner]                                                               # [B, N]
    context = torch.arange(context_len, device=anchors_BA.device)[None, None, :] < p[:, :, None]
    own = (owner[:, None] == owner[None, :]).expand(B, N, N)
    ok = anchor_ok_BA[:, owner][:, :, None]
    allowed = torch.cat([context & ok, own], dim=-1)
    allowed[..., context_len:] |= torch.eye(N, dtype=torch.bool, device=allowed.device)  # padding rows see themselves
    return allowed


def sliding_block_mask(anchors_BA: torch.Tensor, anchor_ok_BA: torch.Tensor, context_len: int, block_size: int,
                       window: int) -> torch.Tensor:
    """The sliding layers' visibility: a query at p + k sees context c < p with (p + k) - c < window, and the slots
    of its own block up to its own (causal)."""
    allowed = block_mask(anchors_BA, anchor_ok_BA, context_len, block_size)
    B, A = anchors_BA.shape
    N = A * block_size
    slot = torch.arange(N, device=anchors_BA.device) % block_size
    query_pos = anchors_BA[:, torch.arange(N, device=anchors_BA.device) // block_size] + slot          # [B, N]
    near = query_pos[:, :, None] - torch.arange(context_len, device=anchors_BA.device) < window
    allowed[..., :context_len] &= near
    allowed[..., context_len:] &= slot[None, :, None] >= slot[None, None, :]
    return allowed


def masks_for(head, anchors_BA, anchor_ok_BA, context_len: int):
    """What `block_hidden` reads: one mask, or one per layer type when the head has sliding layers."""
    full = block_mask(anchors_BA, anchor_ok_BA, context_len, head.block_size)
    if "sliding_attention" not in head.layer_types():
        return full
    return {"full_attention": full, "sliding_attention": sliding_block_mask(anchors_BA, anchor_ok_BA, context_len,
                                                                            head.block_size, head.config["sliding_window"])}


def sample_anchors(valid_BT: torch.Tensor, num_anchors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [B, A], anchor_ok [B, A]): random positions with a loss-carrying next token, A = the most any row has."""
    B, T = valid_BT.shape
    rows = []
    for b in range(B):
        candidates = torch.nonzero(valid_BT[b, 1:T - 1]).flatten() + 1
        pick = torch.randperm(len(candidates), device=valid_BT.device)[:num_anchors]
        rows.append(torch.sort(candidates[pick]).values)
    A = max(1, max(len(r) for r in rows))
    anchors = torch.ones(B, A, dtype=torch.long, device=valid_BT.device)
    ok = torch.zeros(B, A, dtype=torch.bool, device=valid_BT.device)
    for b, r in enumerate(rows):
        anchors[b, :len(r)], ok[b, :len(r)] = r, True
    return anchors, ok


def dpace_weights(ce_BAK: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE: w_j = sum_{m >= j} prod_{i <= m} ((1 - alpha)·exp(-CE_i) + alpha) along each block's slots, detached."""
    with torch.no_grad():
        chance = torch.cumprod((1 - alpha) * torch.exp(-ce_BAK) + alpha, dim=-1)
        return chance.flip(-1).cumsum(-1).flip(-1)


def _group_sums(head, kv, ids, probs, valid, argmax, anchors, ok, T: int):
    """(weighted loss sum, weight sum, hits per slot, counts per slot) of one group of anchors."""
    Bs, device = head.block_size, ids.device
    B, A = anchors.shape
    slots = torch.arange(Bs, device=device)
    tokens = torch.full((B, A, Bs), head.mask_token_id, dtype=torch.long, device=device)
    tokens[:, :, 0] = ids.gather(1, anchors)
    positions = anchors[:, :, None] + slots
    h = head.block_hidden(tokens.view(B, -1), positions.view(B, -1), kv, masks_for(head, anchors, ok, T))
    h = h.view(B, A, Bs, -1)[:, :, 1:]
    rows = (anchors[:, :, None] + slots[1:] - 1).clamp(max=T - 1)                        # teacher rows [B, A, Bs-1]
    inside = (anchors[:, :, None] + slots[1:] - 1) < T
    batch_idx = torch.arange(B, device=device)[:, None, None]
    counts = ok[:, :, None] & inside & valid[batch_idx, rows]
    logits = head.logits(h).float()
    logq = torch.log_softmax(logits, -1)
    loss = position_loss(probs[batch_idx, rows], logq, *head.objective)
    if head.dpace_alpha is None:
        weights = torch.exp(-(slots[1:].float() - 1) / head.gamma)
    else:
        weights = dpace_weights(position_loss(probs[batch_idx, rows], logq.detach()), head.dpace_alpha)
    weighted = (loss * counts * weights).sum()
    with torch.no_grad():
        hits = ((logits.argmax(-1) == argmax[batch_idx, rows]) & counts).sum((0, 1))
    return weighted, (counts * weights).sum(), hits, counts.sum((0, 1))


def dflash_loss(head, batch: dict):
    ids, aux, valid = batch["input_ids"], batch["aux"], batch["target_valid"]
    probs, argmax = batch["target_probs"], batch["target_argmax"]
    B, T = ids.shape
    kv = head.context_kv(head.context(aux), batch["position_ids"])
    anchors, ok = sample_anchors(valid, head.num_anchors)
    Bs, A = head.block_size, anchors.shape[1]
    heads = head.config["num_attention_heads"]
    group = A
    while group > 1 and B * heads * group * Bs * (T + group * Bs) > SCORE_BUDGET:
        group = (group + 1) // 2
    num = den = 0.0
    hits = counts = 0
    for s in range(0, A, group):
        args = (head, kv, ids, probs, valid, argmax, anchors[:, s:s + group], ok[:, s:s + group], T)
        out = checkpoint(_group_sums, *args, use_reentrant=False) if group < A else _group_sums(*args)
        num, den, hits, counts = num + out[0], den + out[1], hits + out[2], counts + out[3]
    loss = num / den.clamp(min=1e-6) if torch.is_tensor(den) else aux.sum() * 0.0
    acc = (hits.float() / counts.clamp(min=1)) if torch.is_tensor(hits) else torch.zeros(Bs - 1, device=ids.device)
    metrics = {f"acc_{k}": acc[k].detach() for k in range(len(acc))}
    metrics["sim_accept_len"] = torch.cumprod(acc.detach(), 0).sum()
    metrics["num_positions"] = valid.sum().detach()
    metrics["num_anchors"] = ok.sum().detach()
    metrics["loss"] = loss.detach()
    return loss, metrics
