"""Training-time test (TTT), shared by every kind that unrolls its own predictions in training
(EAGLE-3, EAGLE-2, MTP): step 0 at position t sees the target's feature f_t and token x_{t+1};
step i feeds the head its own previous output with the true token x_{t+1+i}, RoPE positions
offset by i. Attention: step-0 keys causally, the keys of steps 1..i only on the diagonal (a query
sees its own chain), exactly the pattern a drafted chain has at inference. The scores are the T×T
causal block plus i diagonal columns: no T×T×k mask is ever materialized."""
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
