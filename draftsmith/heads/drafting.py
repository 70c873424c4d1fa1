"""The one interface between a head and the runtime: a `Drafter` keeps the head's own committed
context and proposes a `Tree` (heads/tree.py) from the root token; the runtime verifies it with the
target and tells the drafter what was committed. Drafting is the head's job, so this lives in
`heads/`; `runtime/` imports it and never a kind's module.

Features: what the target runner returns for committed positions, in the form the kind's spec
asked for (`FeatureNeeds`): the concatenated aux layers, or the final normed hidden state.
Position t pairs feature f_t with token x_{t+1}.

CUDA graphs: a drafter routes its fixed-shape step through `compile_step(fn, static_buffers)`,
supplied by the runtime (`runtime/compile.py`); the default runs it eagerly."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from draftsmith.heads import family
from draftsmith.heads.tree import Chains, Tree, assemble_trees, chain_tree

StepCompiler = Callable[..., Callable]  # (fn, static_buffers=()) -> fn with the same signature


def eager(fn, static_buffers: tuple = ()):
    return fn


@dataclass
class TreeConfig:
    depth: int = 6
    top_k: int = 8
    num_nodes: int = 32
    choices: list[list[int]] | None = None  # static trees (Medusa choice lists); None: the kind's own


class Drafter(Protocol):
    """Drafts for B rows at once (`batch_size`, 1 by default), each row with its own committed length;
    the batch-1 calls `extend`/`draft_tree` are the B = 1 case of the same code."""
    tree_cfg: TreeConfig
    batch_size: int

    def reset(self) -> None:
        """Forget every committed position of every row (new prompts follow)."""

    def commit(self, commits: Commits) -> None:
        """Commit, for every row b, its next counts[b] positions: the target's features there and the tokens one
        ahead of them (rows extend by different numbers: each accepted its own path; 0: none)."""

    def draft_trees(self, roots_B: torch.Tensor) -> list:
        """One tree per row, `tree_cfg.num_nodes` nodes at most, rooted at the row's root token."""

    # optional: set_sampling(temperature, gen) for drafters that sample their drafts; calibrate(...)
    # for drafters that shape their tree from measured accuracies; begin_rows(rows, prompts) for
    # drafters that read the prompt's first token too (extend never carries it: the runtime's baselines)


@dataclass
class Commits:
    """What one commit hands every one of B rows, padded: row b's first counts[b] entries of tokens_BT [B, T] (the
    tokens one ahead of the positions) and of feats_BTK [B, T, K] (the target's features there; None for drafters
    that read none). The runtime builds it from the round's accepted paths in one gather, with no step per row."""
    tokens_BT: torch.Tensor
    feats_BTK: torch.Tensor | None
    counts: list[int]

    @cached_property
    def counts_B(self) -> torch.Tensor:
        return torch.tensor(self.counts, device=self.tokens_BT.device)

    @classmethod
    def from_rows(cls, rows: list[int], tokens: list[torch.Tensor], features: list | None, batch_size: int) -> Commits:
        """The listed rows' tokens (and features, unless None) padded to the longest; rows not listed get none."""
        counts = [0] * batch_size
        for r, t in zip(rows, tokens):
            counts[r] = len(t)
        by_row = dict(zip(rows, tokens))
        tokens_BT = pad_rows([by_row.get(b, tokens[0][:0]) for b in range(batch_size)], max(counts))
        if features is None or features[0] is None:
            return cls(tokens_BT, None, counts)
        by_row = dict(zip(rows, features))
        return cls(tokens_BT, pad_rows([by_row.get(b, features[0][:0]) for b in range(batch_size)], max(counts)), counts)

    def rows(self):
        """(row, its tokens, its features or None) for every row that commits any."""
        for b, n in enumerate(self.counts):
            if n:
                yield b, self.tokens_BT[b, :n], None if self.feats_BTK is None else self.feats_BTK[b, :n]


class BatchOfOne:
    """The list and batch-1 calls every drafter offers, as cases of its batched `commit`."""

    def extend_rows(self, rows: list[int], tokens: list[torch.Tensor], features: list | None = None) -> None:
        """Commit tokens[i] (and features[i]) to row rows[i]."""
        self.commit(Commits.from_rows(rows, tokens, features, self.batch_size))

    def extend(self, tokens_T: torch.Tensor, features_TK: torch.Tensor | None = None) -> None:
        self.extend_rows([0], [tokens_T], None if features_TK is None else [features_TK])

    def draft_tree(self, root: torch.Tensor) -> Tree:
        return self.draft_trees(root.view(1))[0]

    def begin(self, prompt_T: torch.Tensor) -> None:
        if hasattr(self, "begin_rows"):
            self.begin_rows([0], [prompt_T])


def attend_with_mask(q, k, v, allowed: torch.Tensor):
    """SDPA over explicit keys with a boolean visibility mask, [N, L] or per row [B, N, L] (GQA expanded by SDPA)."""
    mask = allowed[None, None] if allowed.dim() == 2 else allowed[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def pad_rows(rows: list[torch.Tensor], length: int, fill=0) -> torch.Tensor:
    """[R, length, ...] from R tensors of at most `length` leading entries, padded with `fill`."""
    out = rows[0].new_full((len(rows), length, *rows[0].shape[1:]), fill)
    for r, row in enumerate(rows):
        out[r, :len(row)] = row
    return out


class TreeDrafter(BatchOfOne):
    """The `Drafter` of heads that run one attention layer per step over a draft KV cache of their
    own (EAGLE-3, EAGLE-2, MTP), for B rows at once: a preallocated cache [B, kv, L, d] that keeps each
    row's committed context only (row b's at [0, length_b)), and EAGLE-2 dynamic trees whose node KV
    lives in each row's scratch space past its committed length, overwritten after each round. One
    draft forward per depth serves the whole batch; the last cache slot takes the writes of padding.

    Draft position t pairs target feature f_t with token x_{t+1}. A tree node at depth d of row b is
    fed at draft position (length_b - 1 + d) with its parent's output as hidden state. A head supplies
    `step(tokens, h, positions, attend)`, `logits(h)`, `to_target_ids(ids)`; a kind's subclass says
    how the target's features become the first step's hidden state (`first_hidden`)."""

    def __init__(self, head, max_len: int, tree: TreeConfig, compile_step: StepCompiler = eager, batch_size: int = 1):
        self.head, self.tree_cfg, self.max_len, self.batch_size = head, tree, max_len + 1, batch_size
        p = next(head.parameters())
        num_kv, k_dim, v_dim = family.kv_cache_dims(head.config)
        self.k = torch.zeros((batch_size, num_kv, self.max_len, k_dim), dtype=p.dtype, device=p.device)
        self.v = torch.zeros((batch_size, num_kv, self.max_len, v_dim), dtype=p.dtype, device=p.device)
        self.trash = self.max_len - 1  # where padding entries write: never attended
        self.device, self.lengths = p.device, [0] * batch_size
        self.lengths_B = torch.zeros(batch_size, dtype=torch.long, device=p.device)
        self.h_last = self.logits_last = None
        self.rows_B = torch.arange(batch_size, device=p.device)
        self.step_fn = compile_step(self._step_static, (self.k, self.v))

    def reset(self) -> None:
        self.lengths = [0] * self.batch_size
        self.lengths_B.zero_()

    def _write(self, write_at_BT: torch.Tensor, k, v) -> None:
        """K/V [B, kv, T, d] of every row at its own slots `write_at_BT` (one batched index_put)."""
        rows = self.rows_B[:, None].expand_as(write_at_BT)
        self.k.permute(0, 2, 1, 3).index_put_((rows, write_at_BT), k.transpose(1, 2))
        self.v.permute(0, 2, 1, 3).index_put_((rows, write_at_BT), v.transpose(1, 2))

    @torch.no_grad()
    def commit(self, commits: Commits) -> None:
        """Commit positions [length_b, length_b + counts[b]) of every row in one forward over all B rows
        (rows that commit none, and the padding of shorter ones, write to the trash slot and are not read)."""
        tokens_BT, counts, counts_B = commits.tokens_BT, commits.counts, commits.counts_B
        T, dev, feats_BTK = tokens_BT.shape[1], self.device, commits.feats_BTK.to(self.k.dtype)
        if max(n + c for n, c in zip(self.lengths, counts)) > self.trash:
            raise ValueError(f"draft context exceeds the runtime's max_len={self.max_len - 1}")
        offsets = torch.arange(T, device=dev)
        positions = self.lengths_B[:, None] + offsets
        write_at = torch.where(offsets < counts_B[:, None], positions, self.trash)
        allowed = torch.arange(self.max_len, device=dev)[None, None, :] <= positions[:, :, None]
        allowed[:, :, self.trash] = False

        def attend(q, k, v):
            self._write(write_at, k, v)
            return attend_with_mask(q, self.k, self.v, allowed)

        out = self.head.step(tokens_BT, self.first_hidden(feats_BTK), positions, attend)
        last = out[self.rows_B, (counts_B - 1).clamp(min=0)]                       # [B, H]
        logits = self.head.logits(last[:, None])[:, 0].float()
        if self.h_last is None:
            self.h_last, self.logits_last = torch.zeros_like(last), torch.zeros_like(logits)
        moved = (counts_B > 0)[:, None]
        self.h_last, self.logits_last = torch.where(moved, last, self.h_last), torch.where(moved, logits, self.logits_last)
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]
        self.lengths_B += counts_B

    def first_hidden(self, features_BTK: torch.Tensor) -> torch.Tensor:
        """The hidden state a committed position's first step reads (kinds override)."""
        return features_BTK

    def _step_static(self, tokens_BF, h_BFH, positions_BF, write_at_BF, allowed_BFL):
        """Fixed shapes (B rows, frontier F, whole cache L): writes K/V at `write_at_BF`, attends under
        `allowed_BFL`. This is what CUDA graphs capture; every input is a tensor, nothing syncs."""
        def attend(q, k, v):
            self._write(write_at_BF, k, v)
            return attend_with_mask(q, self.k, self.v, allowed_BFL)

        out = self.head.step(tokens_BF, h_BFH, positions_BF, attend)
        return out, torch.log_softmax(self.head.logits(out).float(), -1)

    def _expand(self, tokens_BF, h_BFH, depth: int, num_tree: int, tree_allowed_BFM):
        """One batched step for every row's frontier. Row b's tree KV goes in its scratch space right
        after its committed context, [length_b, length_b + num_tree + F), overwritten by the next extend."""
        B, F_ = tokens_BF.shape
        if max(self.lengths) + num_tree + F_ > self.trash:
            raise ValueError(f"draft tree does not fit the runtime's max_len={self.max_len - 1}")
        dev, lengths = self.device, self.lengths_B[:, None, None]
        allowed = (torch.arange(self.max_len, device=dev)[None, None, :] < lengths).expand(B, F_, self.max_len).clone()
        if num_tree:
            allowed.scatter_(2, lengths + torch.arange(num_tree, device=dev).expand(B, F_, num_tree), tree_allowed_BFM)
        write_at = self.lengths_B[:, None] + num_tree + torch.arange(F_, device=dev)
        allowed.scatter_(2, write_at[:, :, None], True)
        positions = (self.lengths_B - 1 + depth)[:, None].expand(B, F_)
        return self.step_fn(tokens_BF, h_BFH, positions, write_at, allowed)

    @torch.no_grad()
    def draft_trees(self, roots_B: torch.Tensor) -> list[Tree]:
        """EAGLE-2: expand each row's top-k frontier by cumulative log-prob `depth` times, rerank per row.
        With top_k 1 the trees are chains, drafted without the frontier bookkeeping (same trees)."""
        if self.tree_cfg.top_k == 1:
            return self.draft_chains(roots_B)
        return self.draft_dynamic(roots_B)

    @torch.no_grad()
    def draft_chains(self, roots_B: torch.Tensor) -> Chains:
        length = min(self.tree_cfg.depth, self.tree_cfg.num_nodes - 1)
        draft_ids = self.logits_last.argmax(-1, keepdim=True)                     # [B, 1]
        tokens, h = [self.head.to_target_ids(draft_ids)], self.h_last[:, None]
        B = len(roots_B)
        for depth in range(1, length):
            above = torch.ones(B, 1, depth - 1, dtype=torch.bool, device=self.device)
            out, logp = self._expand(tokens[-1], h, depth, depth - 1, above)
            tokens.append(self.head.to_target_ids(logp.argmax(-1)))
            h = out
        drafted = torch.cat(tokens, 1)[:, :length]
        return Chains(roots_B, drafted)

    @torch.no_grad()
    def draft_dynamic(self, roots_B: torch.Tensor) -> list[Tree]:
        K, dev, B = self.tree_cfg.top_k, self.device, len(roots_B)
        score, draft_ids = torch.topk(torch.log_softmax(self.logits_last, -1), K)      # [B, K]
        cand = {"tokens": [self.head.to_target_ids(draft_ids)], "parent": [torch.full((B, K), -1, device=dev)],
                "score": [score], "depth": [torch.ones(B, K, dtype=torch.long, device=dev)]}
        frontier = torch.arange(K, device=dev).expand(B, K)          # candidate indices per row
        frontier_h = self.h_last[:, None].expand(B, K, self.h_last.shape[-1])
        anc = torch.zeros(B, K, 0, dtype=torch.bool, device=dev)     # frontier x expanded nodes: ancestry
        flat = lambda key: torch.cat(cand[key], 1)  # noqa: E731
        for depth in range(1, self.tree_cfg.depth):
            out, logp = self._expand(flat("tokens").gather(1, frontier), frontier_h, depth, anc.shape[2], anc)
            child_score, child_ids = torch.topk(logp, K, dim=-1)                            # [B, K, K]
            total = flat("score").gather(1, frontier)[:, :, None] + child_score
            base = sum(t.shape[1] for t in cand["tokens"])
            cand["tokens"].append(self.head.to_target_ids(child_ids.flatten(1)))
            cand["parent"].append(frontier.repeat_interleave(K, dim=1))
            cand["score"].append(total.flatten(1))
            cand["depth"].append(torch.full((B, K * K), depth + 1, dtype=torch.long, device=dev))
            best = torch.topk(total.flatten(1), K).indices
            # ancestors of the new frontier among expanded nodes: the parent's row plus the parent itself
            parent_slot = best // K
            eye = torch.eye(K, dtype=torch.bool, device=dev).expand(B, K, K)
            anc = torch.cat([anc, eye], dim=2).gather(1, parent_slot[:, :, None].expand(B, K, anc.shape[2] + K))
            frontier = base + best
            frontier_h = out.gather(1, parent_slot[:, :, None].expand(B, K, out.shape[-1]))
        return assemble_trees(roots_B, flat("tokens"), flat("parent"), flat("score"), flat("depth"),
                              self.tree_cfg.num_nodes, max_depth=self.tree_cfg.depth)
