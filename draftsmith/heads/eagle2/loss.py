"""EAGLE-2's training objective: EAGLE-1's loss (SafeAILab/EAGLE `eagle/train/main.py`), optionally
unrolled with training-time test (no anchor trains EAGLE-1/2 heads this way).

Step i at position t is fed f_t (i = 0: the target's, with the published uniform input noise in
training) or its own step-(i-1) output, and the true token x_{t+1+i}; its output h regresses onto
f_{t+1+i} (SmoothL1, mean over features) and its logits lm_head(h) match the target's distribution
for x_{t+2+i} (soft cross-entropy, full vocabulary, fp32):

    loss = Σ_i decay^i · (feature_weight · SmoothL1 + token_weight · soft CE)   (1.0 and 0.1 published)

over positions whose next token is an assistant token. `ttt_steps: 1` is the published objective."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.heads.objective import soft_ce_sums
from draftsmith.heads.ttt import TTTAttention, shard_of, shift_left, step_targets, ttt_step


def input_noise(features_BTH: torch.Tensor, width: float) -> torch.Tensor:
    """EAGLE's uniform feature noise: U(-width/2, width/2) scaled by 512 / sequence length."""
    if width <= 0:
        return features_BTH
    return features_BTH + (torch.rand_like(features_BTH) - 0.5) * width * 512 / features_BTH.shape[1]


def eagle2_loss(head, batch: dict):
    """Returns (loss, metrics). batch: input_ids_BT, aux_BTH (the target's final hidden states),
    target_probs_BTV (teacher at p predicts token p+1), target_valid_BT, target_argmax_BT, position_ids_BT."""
    ids, pos, features = batch["input_ids"], batch["position_ids"], batch["aux"]
    probs, valid, argmax = batch["target_probs"], batch["target_valid"], batch["target_argmax"]
    T, shard = ids.shape[1], shard_of(batch)
    h = features.to(head.fc.weight.dtype)
    h = shard.local(input_noise(h, head.input_noise) if head.training else h)
    attend = TTTAttention(shard=shard)
    total = torch.zeros((), device=ids.device)
    metrics = {}
    survive = torch.ones((), device=ids.device)
    sim_accept = torch.zeros((), device=ids.device)
    for i in range(head.ttt_steps):
        if T - 1 - i <= 0:
            break
        h = ttt_step(head, head.checkpoint_steps, shard.local(shift_left(ids, 1 + i)), h, shard.local(pos) + i, attend.at(i))
        n, targets = step_targets(shard, T, i)
        mask = valid[:, targets]
        count = valid[:, 1 + i:].sum().clamp(min=1)
        token_sum, hits = soft_ce_sums(head.logits, h[:, :n], probs, targets.start, mask, argmax[:, targets],
                                         objective=head.objective)
        feature_loss = F.smooth_l1_loss(h[:, :n].float(), features[:, targets].float(), reduction="none").mean(-1)
        feature_sum = (feature_loss * mask).sum()
        step_loss = (head.feature_weight * feature_sum + head.token_weight * token_sum) / count
        total = total + (head.loss_decay ** i) * step_loss
        acc = shard.total(hits[0]).float() / count
        survive = survive * acc.detach()
        sim_accept = sim_accept + survive
        metrics[f"loss_{i}"] = shard.total(step_loss.detach())
        metrics[f"feature_loss_{i}"] = shard.total(feature_sum.detach()) / count
        metrics[f"token_loss_{i}"] = shard.total(token_sum.detach()) / count
        metrics[f"acc_{i}"] = acc.detach()
    metrics["sim_accept_len"] = sim_accept
    metrics["num_positions"] = valid.sum().detach()
    metrics["loss"] = shard.total(total.detach())  # this shard's share is what backward sees
    return total, metrics
