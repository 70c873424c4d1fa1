"""Training-time test (TTT) for EAGLE-3.

Step 0 at position t sees feature f_t and token x_{t+1} and predicts x_{t+2}; step i feeds the
head's own previous (pre-norm) hidden with the true token x_{t+1+i}, RoPE positions offset by i.
Attention: step-0 keys causally, the keys of steps 1..i only on the diagonal (a query sees its own
chain), exactly the pattern the drafted chain has at inference. The scores are the T×T causal block
plus i diagonal columns: no T×T×k mask is ever materialized.

Loss = Σ_i decay^i · soft cross-entropy(teacher restricted to the draft vocabulary, draft), fp32,
over positions whose teacher argmax lies inside the draft vocabulary.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _repeat_kv(x, num_heads: int):
    return x if x.shape[1] == num_heads else x.repeat_interleave(num_heads // x.shape[1], dim=1)


class TTTAttention:
    """Holds the keys/values of every unrolled step; called once per step by the attention layer."""

    def __init__(self):
        self.keys, self.values = [], []

    def __call__(self, q_BhTd, k, v):
        self.keys.append(k)
        self.values.append(v)
        heads, T = q_BhTd.shape[1], q_BhTd.shape[2]
        if len(self.keys) == 1:
            return F.scaled_dot_product_attention(q_BhTd, k, v, is_causal=True, enable_gqa=heads != k.shape[1])
        scale = 1.0 / math.sqrt(q_BhTd.shape[-1])
        k0, v0 = _repeat_kv(self.keys[0], heads), _repeat_kv(self.values[0], heads)
        causal = torch.ones(T, T, dtype=torch.bool, device=q_BhTd.device).tril()
        block = (q_BhTd @ k0.transpose(-1, -2)).float() * scale
        block = block.masked_fill(~causal, float("-inf"))
        diag = torch.stack([(q_BhTd * _repeat_kv(kj, heads)).sum(-1).float() * scale for kj in self.keys[1:]], dim=-1)
        weights = torch.softmax(torch.cat([block, diag], dim=-1), dim=-1).to(q_BhTd.dtype)
        out = weights[..., :T] @ v0
        for j, vj in enumerate(self.values[1:]):
            out = out + weights[..., T + j, None] * _repeat_kv(vj, heads)
        return out


def shift_left(x_BT, n: int, fill: int = 0):
    """x[:, t] <- x[:, t + n], padded at the end."""
    if n == 0:
        return x_BT
    pad = torch.full_like(x_BT[:, :n], fill)
    return torch.cat([x_BT[:, n:], pad], dim=1)


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
    survive = sim_accept = torch.ones((), device=ids.device)
    sim_accept = sim_accept * 0
    for i in range(head.ttt_steps):
        n = T - 1 - i
        if n <= 0:
            break
        h = head.step(shift_left(ids, 1 + i), h, pos + i, attend)
        logits = head.logits(h[:, :n]).float()
        mask = valid[:, 1 + i:]
        count = mask.sum().clamp(min=1)
        step_loss = -(probs[:, 1 + i:] * torch.log_softmax(logits, dim=-1)).sum(-1)
        step_loss = (step_loss * mask).sum() / count
        total = total + (head.loss_decay ** i) * step_loss
        acc = ((logits.argmax(-1) == argmax[:, 1 + i:]) & mask).sum().float() / count
        survive = survive * acc.detach()
        sim_accept = sim_accept + survive
        metrics[f"loss_{i}"] = step_loss.detach()
        metrics[f"acc_{i}"] = acc.detach()
    # metrics stay on the device (no host sync per step); the trainer reads them when it logs
    metrics["sim_accept_len"] = sim_accept
    metrics["num_positions"] = valid.sum().detach()
    return total, metrics
