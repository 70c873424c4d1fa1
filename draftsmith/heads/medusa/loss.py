"""Medusa's training objective (paper §2.2; the reference trains hard-label CE, we distil): head k
at position t matches the target's distribution of token t+2+k (the teacher at position t+1+k;
on regenerated data the target's own output, so this is self-distillation):

    loss = Σ_k decay^k · soft CE(head_k(f_t), p_target(x_{t+2+k}))       (decay 0.8)

over positions whose predicted token is an assistant token. Logged per head: top-1 and top-5
accuracy against the target's argmax, and the chain acceptance they imply (sim_accept_len)."""
from __future__ import annotations

import torch

from draftsmith.heads.objective import soft_ce_sums

TOP_K_LOGGED = (1, 5)


def medusa_loss(head, batch: dict):
    """Returns (loss, metrics). batch: aux_BTH (the target's final hidden states), target_probs_BTV
    (the teacher at p predicts token p+1), target_valid_BT, target_argmax_BT."""
    features, probs = batch["aux"], batch["target_probs"]
    valid, argmax = batch["target_valid"], batch["target_argmax"]
    T = features.shape[1]
    total = torch.zeros((), device=features.device)
    metrics, survive, sim_accept = {}, torch.ones((), device=features.device), torch.zeros((), device=features.device)
    for k in range(head.num_heads):
        n = T - 1 - k
        if n <= 0:
            break
        mask = valid[:, 1 + k:]
        count = mask.sum().clamp(min=1)
        ce_sum, hits = soft_ce_sums(lambda f, k=k: head.one_head_logits(k, f), features[:, :n], probs, 1 + k,
                                    mask, argmax[:, 1 + k:], TOP_K_LOGGED, objective=head.objective)
        head_loss = ce_sum / count
        total = total + head.loss_decay ** k * head_loss
        for j, num_hits in zip(TOP_K_LOGGED, hits):
            metrics[f"top{j}_{k}"] = (num_hits.float() / count).detach()
        metrics[f"loss_{k}"] = head_loss.detach()
        survive = survive * metrics[f"top1_{k}"]
        sim_accept = sim_accept + survive
    metrics["sim_accept_len"] = sim_accept
    metrics["num_positions"] = valid.sum().detach()
    return total, metrics
