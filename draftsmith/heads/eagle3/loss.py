"""Training-time test (TTT) for EAGLE-3 (the attention pattern: heads/ttt.py).

Step 0 at position t sees feature f_t and token x_{t+1} and predicts x_{t+2}; step i feeds the
head's own previous (pre-norm) hidden with the true token x_{t+1+i}, RoPE positions offset by i.

Loss = Σ_i decay^i · soft cross-entropy(teacher restricted to the draft vocabulary, draft), fp32,
over positions whose teacher argmax lies inside the draft vocabulary.
"""
from __future__ import annotations

import torch

from draftsmith.heads.objective import soft_ce_sums
from draftsmith.heads.ttt import TTTAttention, shift_left, ttt_step


def ttt_loss(head, batch: dict):
    """Returns (loss, metrics). batch: input_ids_BT, aux_BTK, target_probs_BTV (draft vocab, teacher at
    position p predicts token p+1), target_valid_BT, target_argmax_BT (draft ids), position_ids_BT."""
    ids, pos = batch["input_ids"], batch["position_ids"]
    probs, valid, argmax = batch["target_probs"], batch["target_valid"], batch["target_argmax"]
    T = ids.shape[1]
    h = head.fc(batch["aux"].to(head.fc.weight.dtype))
    attend = TTTAttention()
    total = torch.zeros((), device=ids.device)
    metrics = {}
    survive, sim_accept = torch.ones((), device=ids.device), torch.zeros((), device=ids.device)
    for i in range(head.ttt_steps):
        n = T - 1 - i
        if n <= 0:
            break
        h = ttt_step(head, head.checkpoint_steps, shift_left(ids, 1 + i), h, pos + i, attend.at(i))
        mask = valid[:, 1 + i:]
        count = mask.sum().clamp(min=1)
        ce_sum, hits = soft_ce_sums(head.logits, h[:, :n], probs, 1 + i, mask, argmax[:, 1 + i:])
        step_loss = ce_sum / count
        total = total + (head.loss_decay ** i) * step_loss
        acc = hits[0].float() / count
        survive = survive * acc.detach()
        sim_accept = sim_accept + survive
        metrics[f"loss_{i}"] = step_loss.detach()
        metrics[f"acc_{i}"] = acc.detach()
    # metrics stay on the device (no host sync per step); the trainer reads them when it logs
    metrics["sim_accept_len"] = sim_accept
    metrics["num_positions"] = valid.sum().detach()
    return total, metrics
