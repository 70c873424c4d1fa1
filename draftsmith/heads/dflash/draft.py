"""Drafting with a DFlash head: one forward per round over [bonus, MASK x d] for every row at once, d = min(validate.depth,
B - 1) the tokens drafted (an engine serving the head with num_speculative_tokens = d runs the same block).

Each row keeps every layer's context K/V for its committed positions, computed once, in the first block after the
target's features for them arrive (`commit` keeps them): every layer projects [new context rows ; block rows]
in one go, as the reference's forward does, so that a round is one draft forward. The block's own K/V are written
after the longest row's context (scratch slots, read in place with the context: no copy of the cache) and
overwritten by later commits. The block's slots 1..d
give a chain of d tokens: their argmax (deterministic drafts, which the runtime's
verification keeps lossless under sampling too); with `validate.top_k` > 1 a DDTree of `validate.num_nodes` nodes
over the slots' marginals (`heads/tree.marginal_trees`)."""
from __future__ import annotations

import torch

from draftsmith.heads.drafting import BatchOfOne, Commits, TreeConfig, eager
from draftsmith.heads.tree import Tree, marginal_trees


class DFlashDrafter(BatchOfOne):
    def __init__(self, head, max_len: int, tree: TreeConfig, compile_step=eager, batch_size: int = 1):
        self.head, self.tree_cfg, self.batch_size, self.max_len = head, tree, batch_size, max_len
        self.depth = max(1, min(tree.depth, head.block_size - 1, tree.num_nodes - 1 if tree.top_k <= 1 else tree.depth))
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = head.config
        shape = (len(head.layers), batch_size, cfg["num_key_value_heads"], max_len + head.block_size, cfg["head_dim"])
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.reset()

    def reset(self) -> None:
        self.lengths = [0] * self.batch_size
        self.pending: list[Commits] = []  # committed since the last block, context K/V not yet computed

    def commit(self, commits: Commits) -> None:
        """Every row's newly committed positions (their features; the tokens are not read): kept until the next
        block, whose forward computes their context K/V with its own (one draft forward per round)."""
        waiting = [sum(c) for c in zip(self.lengths, *(p.counts for p in self.pending), commits.counts)]
        if max(waiting) > self.max_len:
            raise ValueError(f"DFlash context of {max(waiting)} positions exceeds the drafter's max_len={self.max_len}")
        self.pending.append(commits)

    def _pending_rows(self):
        """(features [B, P, K], counts) of every row's positions committed since the last block, in order."""
        if len(self.pending) == 1:
            only = self.pending[0]
            return only.feats_BTK[:, :max(only.counts)], only.counts
        counts = [sum(c) for c in zip(*(p.counts for p in self.pending))]
        first = self.pending[0].feats_BTK
        feats_BPK = first.new_zeros(self.batch_size, max(counts), first.shape[-1])
        done_B = torch.zeros(self.batch_size, dtype=torch.long, device=first.device)
        for p in self.pending:  # each commit's rows after what the earlier ones brought
            T = p.feats_BTK.shape[1]
            rows, cols = torch.nonzero(torch.arange(T, device=first.device) < p.counts_B[:, None], as_tuple=True)
            feats_BPK[rows, done_B[rows] + cols] = p.feats_BTK[rows, cols]
            done_B += p.counts_B
        return feats_BPK, counts

    def _take_pending(self):
        """(context rows [B, P, H], their positions [B, P], store) for the positions committed since the last block
        (None if there are none); `lengths` then count them. store(layer, k, v) writes each row's own to its cache."""
        if not any(any(p.counts) for p in self.pending):
            self.pending = []
            return None
        feats_BPK, counts = self._pending_rows()
        P = feats_BPK.shape[1]
        starts = list(self.lengths)
        positions = torch.tensor(starts, device=self.device)[:, None] + torch.arange(P, device=self.device)
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]
        self.pending = []
        if len(counts) == 1:  # one row: its new positions are one contiguous run of slots
            def store(layer, k, v):
                self.k[layer][:1, :, starts[0]:starts[0] + P], self.v[layer][:1, :, starts[0]:starts[0] + P] = k, v
        else:
            new = torch.arange(P, device=self.device)[None, :] < torch.tensor(counts, device=self.device)[:, None]
            row_idx, pos_idx = torch.nonzero(new, as_tuple=True)
            slots = positions[row_idx, pos_idx]

            def store(layer, k, v):
                self.k[layer][row_idx, :, slots] = k.transpose(1, 2)[row_idx, pos_idx]
                self.v[layer][row_idx, :, slots] = v.transpose(1, 2)[row_idx, pos_idx]
        return self.head.context(feats_BPK.to(self.device)), positions, store

    @torch.no_grad()
    def draft_trees(self, roots_B: torch.Tensor) -> list[Tree]:
        logits = self.block_logits(roots_B, self.depth)
        return marginal_trees(roots_B, logits, self.tree_cfg.top_k, self.tree_cfg.num_nodes, self.head.to_target_ids)

    @torch.no_grad()
    def block_logits(self, roots_B: torch.Tensor, slots: int | None = None) -> torch.Tensor:
        """[B, slots, V] fp32 over the head's (draft) vocabulary (slots default block_size - 1): for every row, in one forward, the block [root, MASK x slots]
        (every slot sees the block both ways), as an engine serving it with num_speculative_tokens = slots runs it:
        at large batch sizes a short block costs a fraction of the full one."""
        N, B = (slots or self.head.block_size - 1) + 1, len(roots_B)  # the block: its root and `slots` masks
        new_ctx = self._take_pending()
        lengths = torch.tensor(self.lengths, device=self.device)
        L = max(self.lengths)
        tokens = torch.full((B, N), self.head.mask_token_id, dtype=torch.long, device=self.device)
        tokens[:, 0] = roots_B
        positions = lengths[:, None] + torch.arange(N, device=self.device)
        sliding = "sliding_attention" in self.head.layer_types()
        if min(self.lengths) == L and not sliding:  # every row sees all L context slots and its block: no mask
            allowed = None
        else:
            allowed = torch.cat([(torch.arange(L, device=self.device)[None, :] < lengths[:, None])[:, None, :].expand(B, N, L),
                                 torch.ones(B, N, N, dtype=torch.bool, device=self.device)], dim=-1)
        if sliding:  # the context within the window, the block causal
            near = positions[:, :, None] - torch.arange(L, device=self.device) < self.head.config["sliding_window"]
            causal = torch.ones(N, N, dtype=torch.bool, device=self.device).tril()
            windowed = torch.cat([allowed[..., :L] & near, allowed[..., L:] & causal], dim=-1)
            allowed = {"full_attention": allowed, "sliding_attention": windowed}
        kv = [(self.k[i, :B], self.v[i, :B]) for i in range(len(self.head.layers))]  # the block's K/V go to slots L.. (room: block_size)
        h = self.head.block_hidden(tokens, positions, kv, allowed, scratch=L, new_ctx=new_ctx)
        return self.head.logits(h[:, 1:]).float()
