"""MTP's training objective, post hoc (FastMTP; speculators' MTP fine-tuning) or joint: the module is
unrolled for k steps, step i fed its own step-(i-1) output (step 0: the target's final feature f_t)
and the true token x_{t+1+i}, predicting x_{t+2+i}; soft cross-entropy against the target's
distribution (fp32, full vocabulary) over positions whose predicted token is an assistant token:

    loss = Σ_i w_i · soft CE_i,    w_i = beta^i / Σ_j beta^j     (beta 0.6: weights 0.51, 0.31, 0.18 for k = 3)

Step i runs module i % D. Attention between steps follows training-time test (heads/ttt.py).
Logged: loss_i, acc_i (top-1 against the target's argmax), and the simulated acceptance length."""
from __future__ import annotations

import torch

from draftsmith.heads.objective import soft_ce_sums
from draftsmith.heads.ttt import TTTAttention, shard_of, shift_left, step_targets, ttt_step


def step_weights(num_steps: int, beta: float) -> list[float]:
    raw = [beta ** i for i in range(num_steps)]
    return [w / sum(raw) for w in raw]


def mtp_loss(head, batch: dict):
    ids, pos, h = batch["input_ids"], batch["position_ids"], batch["aux"]
    probs, valid, argmax = batch["target_probs"], batch["target_valid"], batch["target_argmax"]
    T, shard = ids.shape[1], shard_of(batch)
    h = shard.local(h).to(head.modules_[0].eh_proj.weight.dtype)
    attend = TTTAttention(shard=shard)
    weights = step_weights(head.ttt_steps, head.beta)
    total = torch.zeros((), device=ids.device)
    metrics, survive, sim_accept = {}, torch.ones((), device=ids.device), torch.zeros((), device=ids.device)
    for i in range(head.ttt_steps):
        if T - 1 - i <= 0:
            break
        h = ttt_step(head, head.checkpoint_steps, shard.local(shift_left(ids, 1 + i)), h, shard.local(pos) + i,
                     attend.at(i), module=i)
        n, targets = step_targets(shard, T, i)
        mask = valid[:, targets]
        count = valid[:, 1 + i:].sum().clamp(min=1)
        ce_sum, hits = soft_ce_sums(lambda x, m=i: head.logits(x, module=m), h[:, :n], probs, targets.start, mask,
                                    argmax[:, targets], objective=head.objective)
        step_loss = ce_sum / count
        total = total + weights[i] * step_loss
        acc = shard.total(hits[0]).float() / count
        survive = survive * acc.detach()
        sim_accept = sim_accept + survive
        metrics[f"loss_{i}"], metrics[f"acc_{i}"] = shard.total(step_loss.detach()), acc.detach()
    metrics["sim_accept_len"] = sim_accept
    metrics["num_positions"] = valid.sum().detach()
    metrics["loss"] = shard.total(total.detach())  # this shard's share is what backward sees
    return total, metrics
