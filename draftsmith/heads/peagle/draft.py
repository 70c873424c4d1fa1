"""Drafting with a P-EAGLE head: one forward per round gives the whole chain.

Each row keeps every layer's K/V of its committed positions ([0, length_b) of a preallocated cache). `commit`
runs, in one forward over all rows, the newly committed positions (token x_{t+1}, feature f_t, as EAGLE-3) and
K - 1 placeholder slots [MASK, mask_hidden] at positions length_b - 1 + d right after them (their K/V in the
row's scratch space, overwritten next round). A query at position p sees every cache slot <= p: the committed
context for committed rows, the context and the earlier placeholders for slot d. The last committed row gives
draft token 1, slot d token d + 1; `draft_trees` returns that chain (argmax drafts: deterministic, which the
runtime's verification keeps lossless under sampling too), or with `validate.top_k` > 1 a DDTree of
`validate.num_nodes` nodes over the slots' marginals (`heads/tree.marginal_trees`)."""
from __future__ import annotations

import torch

from draftsmith.heads.drafting import BatchOfOne, Commits, TreeConfig, attend_with_mask, eager
from draftsmith.heads.tree import Tree, marginal_trees


class PEagleDrafter(BatchOfOne):
    def __init__(self, head, max_len: int, tree: TreeConfig, compile_step=eager, batch_size: int = 1):
        self.head, self.tree_cfg, self.batch_size = head, tree, batch_size
        self.num_tokens = max(1, min(tree.depth, tree.num_nodes - 1 if tree.top_k <= 1 else tree.depth))
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = head.config
        self.size = max_len + self.num_tokens + 1          # committed + placeholders + the trash slot
        self.trash = self.size - 1
        shape = (len(head.layers), batch_size, cfg["num_key_value_heads"], self.size, cfg["head_dim"])
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.lengths = [0] * batch_size
        self.drafts = None                                   # [B, K, V_draft] logits of each row's next chain
        self.rows_B = torch.arange(batch_size, device=self.device)

    def reset(self) -> None:
        self.lengths = [0] * self.batch_size

    def _inputs(self, commits: Commits):
        """Tokens [B, T + K - 1], first hidden states, positions and cache slots of every row's new rows."""
        tokens_BT, counts, counts_B = commits.tokens_BT, commits.counts, commits.counts_B
        T, K, feats = tokens_BT.shape[1], self.num_tokens, commits.feats_BTK.to(self.dtype)
        if max(n + c for n, c in zip(self.lengths, counts)) + K > self.trash:
            raise ValueError(f"draft context exceeds the runtime's max_len={self.size - self.num_tokens - 1}")
        B, dev = self.batch_size, self.device
        lengths_B = torch.tensor(self.lengths, device=dev)
        committed = lengths_B[:, None] + torch.arange(T, device=dev)
        slots = (lengths_B + counts_B - 1)[:, None] + torch.arange(1, K, device=dev)
        positions = torch.cat([committed, slots], dim=1)
        write_at = torch.cat([torch.where(torch.arange(T, device=dev) < counts_B[:, None], committed, self.trash), slots], 1)
        tokens_BN = torch.cat([tokens_BT, torch.full((B, K - 1), self.head.mask_token_id, dtype=torch.long, device=dev)], 1)
        hidden = torch.cat([self.head.project(feats), self.head.mask_state().expand(B, K - 1, -1)], dim=1)
        return tokens_BN, hidden, positions, write_at, counts_B, counts

    @torch.no_grad()
    def commit(self, commits: Commits) -> None:
        """Commit every row's new positions and draft its next chain, all rows in one forward."""
        tokens_BN, hidden, positions, write_at, counts_B, counts = self._inputs(commits)
        allowed = torch.arange(self.size, device=self.device)[None, None, :] <= positions[:, :, None]
        allowed[:, :, self.trash] = False
        batch_rows = self.rows_B[:, None].expand_as(write_at)

        def attend_for(i):
            def attend(q, k, v):
                self.k[i].permute(0, 2, 1, 3).index_put_((batch_rows, write_at), k.transpose(1, 2))
                self.v[i].permute(0, 2, 1, 3).index_put_((batch_rows, write_at), v.transpose(1, 2))
                return attend_with_mask(q, self.k[i], self.v[i], allowed)
            return attend

        h = self.head.run(tokens_BN, hidden, positions, attend_for)
        T = tokens_BN.shape[1] - (self.num_tokens - 1)
        last = h[self.rows_B, (counts_B - 1).clamp(min=0)]
        chain = torch.cat([last[:, None], h[:, T:]], dim=1)                                   # [B, K, H]
        logits = self.head.logits(chain).float()                                              # [B, K, V_draft]
        self.chain_logits = logits
        self.drafts = logits if self.drafts is None else torch.where((counts_B > 0)[:, None, None], logits, self.drafts)
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]

    @torch.no_grad()
    def draft_trees(self, roots_B: torch.Tensor) -> list[Tree]:
        return marginal_trees(roots_B, self.drafts[:len(roots_B)], self.tree_cfg.top_k, self.tree_cfg.num_nodes,
                              self.head.to_target_ids)
