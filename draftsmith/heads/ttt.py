"""Training-time test (TTT), shared by every kind that unrolls its own predictions in training
(EAGLE-3, EAGLE-2, MTP): step 0 at position t sees the target's feature f_t and token x_{t+1};
step i feeds the head its own previous output with the true token x_{t+1+i}, RoPE positions
offset by i. Attention: step-0 keys causally, the keys of steps 1..i only on the diagonal (a query
sees its own chain), exactly the pattern a drafted chain has at inference.

Memory is linear in the sequence length: step 0 is SDPA's causal kernel (flash on CPU and CUDA);
a later step runs over query blocks, each scoring only the step-0 keys up to its own end plus its
i diagonal columns in one softmax (fp32), so no T x T tensor exists. When a sequence needs more
than one block, each block is checkpointed: backward recomputes its scores instead of keeping them.
`ttt_step` checkpoints a whole unrolled step (`head.checkpoint_steps`), for samples whose per-step
activations would not fit."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

SCORE_BUDGET = 2 ** 24  # fp32 score elements one query block may hold (64 MiB)


def _repeat_kv(x, num_heads: int):
    return x if x.shape[1] == num_heads else x.repeat_interleave(num_heads // x.shape[1], dim=1)


def _block_attention(q_BhCd, k0, v0, diag_keys, diag_values, start: int, local: int):
    """Queries at global positions [start, start + C) over step-0 keys [0, start + C) (causal) and their
    own diagonal keys of steps 1..i (held locally from `local`), one softmax in fp32. Grouped-query heads
    score their shared KV head as one [group x C] query matrix, so no block copies the keys per head."""
    B, heads, C, d = q_BhCd.shape
    kv_heads, end = k0.shape[1], start + C
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(d)
    q_grouped = q_BhCd.reshape(B, kv_heads, group * C, d)
    scores = (q_grouped @ k0[:, :, :end].transpose(-1, -2)).float().view(B, heads, C, end) * scale
    causal = torch.arange(end, device=q_BhCd.device)[None, :] <= torch.arange(start, end, device=q_BhCd.device)[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    if diag_keys:
        diag = [(q_BhCd * _repeat_kv(kj[:, :, local:local + C], heads)).sum(-1).float() * scale for kj in diag_keys]
        scores = torch.cat([scores, torch.stack(diag, dim=-1)], dim=-1)
    weights = torch.softmax(scores, dim=-1).to(q_BhCd.dtype)
    out = (weights[..., :end].reshape(B, kv_heads, group * C, end) @ v0[:, :, :end]).view(B, heads, C, v0.shape[-1])
    for j, vj in enumerate(diag_values):
        out = out + weights[..., end + j, None] * _repeat_kv(vj[:, :, local:local + C], heads)
    return out


@dataclass(frozen=True)
class SequenceShard:
    """The positions [start, end) of a sample that this rank computes; `group` is the sequence-parallel
    group whose ranks hold the other shards (None: one process holds the whole sample). Shards are of
    equal length; the last one runs past the sample's end, and those positions are never attended to
    (causal) nor counted. Every rank holds the whole sample's token ids and teacher; the head's
    activations exist only for its own shard."""
    start: int
    end: int
    group: object = None

    @classmethod
    def split(cls, num_tokens: int, rank: int, size: int, group=None) -> "SequenceShard":
        length = -(-num_tokens // size)
        return cls(rank * length, (rank + 1) * length, group)

    def local(self, x_BT):
        """x[:, start:end] along dim 1, zero-padded past the sample's end."""
        part = x_BT[:, self.start:self.end]
        missing = (self.end - self.start) - part.shape[1]
        return part if missing == 0 else torch.cat([part, part.new_zeros(part.shape[0], missing, *part.shape[2:])], dim=1)

    def gather(self, x_BhLd):
        """Every shard's keys (or values) in sequence order, differentiable (backward sums each shard's share)."""
        if self.group is None:
            return x_BhLd
        from torch.distributed._functional_collectives import all_gather_single_autograd
        return all_gather_single_autograd(x_BhLd.contiguous(), gather_dim=2, group=self.group)

    def total(self, x):
        """A metric summed over the group's shards (no gradient)."""
        if self.group is None:
            return x
        import torch.distributed as dist
        x = x.detach().clone()
        dist.all_reduce(x, group=self.group)
        return x


def query_block(batch_heads: int, num_queries: int, num_keys: int, budget: int | None = None) -> int:
    """Queries per block so that a block's scores (batch x heads x block x keys) stay in `budget`."""
    return max(1, min(num_queries, (budget or SCORE_BUDGET) // max(1, batch_heads * num_keys)))


class TTTAttention:
    """Holds the keys/values of every unrolled step. `at(i)` is step i's attention function: it
    (re)places step i's keys, so a checkpointed step recomputed in backward sees what it saw first.
    Under sequence parallelism (`shard.group`) the step-0 keys and values of every shard are gathered;
    a later step's diagonal keys are its own positions', so they never leave the rank."""

    def __init__(self, budget: int | None = None, shard: SequenceShard | None = None):
        self.keys, self.values, self.budget, self.shard = [], [], budget, shard

    def at(self, i: int):
        return lambda q, k, v: self._attend(i, q, k, v)

    def _attend(self, i: int, q_BhTd, k, v):
        del self.keys[i:], self.values[i:]
        sharded = self.shard is not None and self.shard.group is not None
        self.keys.append(self.shard.gather(k) if i == 0 and sharded else k)
        self.values.append(self.shard.gather(v) if i == 0 and sharded else v)
        heads, T = q_BhTd.shape[1], q_BhTd.shape[2]
        if i == 0 and not sharded:
            return F.scaled_dot_product_attention(q_BhTd, k, v, is_causal=True, enable_gqa=heads != k.shape[1])
        start = self.shard.start if sharded else 0
        step = query_block(q_BhTd.shape[0] * heads, T, start + T + i, self.budget)
        args = (self.keys[0], self.values[0], self.keys[1:], self.values[1:])
        if step >= T:
            return _block_attention(q_BhTd, *args, start, 0)
        blocks = [checkpoint(_block_attention, q_BhTd[:, :, s:s + step], *args, start + s, s, use_reentrant=False)
                  for s in range(0, T, step)]
        return torch.cat(blocks, dim=2)


def shard_of(batch: dict) -> SequenceShard:
    """The batch's sequence shard (train/trainer.py sets one under train.sequence_parallel), else the whole sample."""
    return batch.get("sequence_shard") or SequenceShard(0, batch["input_ids"].shape[1])


def step_targets(shard: SequenceShard, num_tokens: int, i: int) -> tuple[int, slice]:
    """(how many of this shard's positions predict a token at unrolled step i, where their targets are):
    position t's step-i prediction is token t + 2 + i, read at the teacher's index t + 1 + i."""
    count = max(0, min(shard.end, num_tokens - 1 - i) - shard.start)
    return count, slice(shard.start + 1 + i, shard.start + 1 + i + count)


def ttt_step(head, checkpointed: bool, *args, **kwargs):
    """head.step(*args), through activation checkpointing when asked (backward recomputes the step)."""
    if checkpointed and torch.is_grad_enabled():
        return checkpoint(head.step, *args, use_reentrant=False, **kwargs)
    return head.step(*args, **kwargs)


def shift_left(x_BT, n: int, fill: int = 0):
    """x[:, t] <- x[:, t + n], padded at the end."""
    if n == 0:
        return x_BT
    pad = torch.full_like(x_BT[:, :n], fill)
    return torch.cat([x_BT[:, n:], pad], dim=1)
