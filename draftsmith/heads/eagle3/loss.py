"""Training-time test (TTT) for EAGLE-3 (the attention pattern: heads/ttt.py).

Step 0 at position t sees feature f_t and token x_{t+1} and predicts x_{t+2}; step i feeds the
head's own previous (pre-norm) hidden with the true token x_{t+1+i}, RoPE positions offset by i.

Loss = Σ_i decay^i · soft cross-entropy(teacher restricted to the draft vocabulary, draft), fp32,
over positions whose teacher argmax lies inside the draft vocabulary.
"""
from __future__ import annotations

import torch

from draftsmith.heads.objective import soft_ce_sums
from draftsmith.heads.ttt import TTTAttention, shard_of, shift_left, step_targets, ttt_step


def ttt_loss(head, batch: dict):
    """Returns (loss, metrics). batch: input_ids_BT, aux_BTK, target_probs_BTV (draft vocab, teacher at
    position p predicts token p+1), target_valid_BT, target_argmax_BT (draft ids), position_ids_BT."""
    ids, pos = batch["input_ids"], batch["position_ids"]
    probs, valid, argmax = batch["target_probs"], batch["target_valid"], batch["target_argmax"]
    T, shard = ids.shape[1], shard_of(batch)
    h = head.project(shard.local(batch["aux"]))
    attend = TTTAttention(shard=shard)
    total = torch.zeros((), device=ids.device)
    metrics = {}
    survive, sim_accept = torch.ones((), device=ids.device), torch.zeros((), device=ids.device)
    for i in range(head.ttt_steps):
        if T - 1 - i <= 0:
            break
        h = ttt_step(head, head.checkpoint_steps, shard.local(shift_left(ids, 1 + i)), h, shard.local(pos) + i, attend.at(i))
        n, targets = step_targets(shard, T, i)
        mask = valid[:, targets]
        count = valid[:, 1 + i:].sum().clamp(min=1)
        ce_sum, hits = soft_ce_sums(head.logits, h[:, :n], probs, targets.start, mask, argmax[:, targets],
                                      objective=head.objective)
        step_loss = ce_sum / count
        total = total + (head.loss_decay ** i) * step_loss
        acc = shard.total(hits[0]).float() / count
        survive = survive * acc.detach()
        sim_accept = sim_accept + survive
        metrics[f"loss_{i}"] = shard.total(step_loss.detach())
        metrics[f"acc_{i}"] = acc.detach()
    # metrics stay on the device (no host sync per step); the trainer reads them when it logs
    metrics["sim_accept_len"] = sim_accept
    metrics["num_positions"] = valid.sum().detach()
    metrics["loss"] = shard.total(total.detach())  # this shard's share is what backward sees
    return total, metrics
