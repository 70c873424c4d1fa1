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
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from draftsmith.heads import family
from draftsmith.heads.tree import Tree, assemble_tree, chain_tree

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
    tree_cfg: TreeConfig

    def reset(self) -> None:
        """Forget every committed position (a new prompt follows)."""

    def extend(self, tokens_T: torch.Tensor, features_TK: torch.Tensor) -> None:
        """Commit T positions: the target's features there and the tokens one ahead of them."""

    def draft_tree(self, root: torch.Tensor) -> Tree:
        """A tree of `tree_cfg.num_nodes` nodes at most, rooted at `root` (the target's last token)."""

    # optional: set_sampling(temperature, gen) for drafters that sample their drafts; calibrate(...)
    # for drafters that shape their tree from measured accuracies; begin(prompt_T) for drafters that
    # read the prompt's first token too (extend never carries it: the runtime's baselines)


def attend_with_mask(q, k, v, allowed_NL: torch.Tensor):
    """SDPA over explicit keys with a boolean [N, L] visibility mask (GQA expanded by SDPA)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_NL[None, None], enable_gqa=q.shape[1] != k.shape[1])


class TreeDrafter:
    """The `Drafter` of heads that run one attention layer per step over a draft KV cache of their
    own (EAGLE-3, EAGLE-2, MTP): a preallocated cache that keeps committed context only, and an
    EAGLE-2 dynamic tree whose node KV lives in scratch space past the committed length, dropped
    (overwritten) after each round.

    Draft position t pairs target feature f_t with token x_{t+1}. A tree node at depth d is fed at
    draft position (committed - 1 + d) with its parent's output as hidden state. A head supplies
    `step(tokens, h, positions, attend)`, `logits(h)`, `to_target_ids(ids)`; a kind's subclass says
    how the target's features become the first step's hidden state (`first_hidden`)."""

    def __init__(self, head, max_len: int, tree: TreeConfig, compile_step: StepCompiler = eager):
        self.head, self.tree_cfg, self.max_len = head, tree, max_len
        p = next(head.parameters())
        num_kv, k_dim, v_dim = family.kv_cache_dims(head.config)
        self.k = torch.zeros((1, num_kv, max_len, k_dim), dtype=p.dtype, device=p.device)
        self.v = torch.zeros((1, num_kv, max_len, v_dim), dtype=p.dtype, device=p.device)
        self.device, self.length = p.device, 0
        self.h_last = self.logits_last = None
        self.step_fn = compile_step(self._step_static, (self.k, self.v))

    def reset(self) -> None:
        self.length = 0

    @torch.no_grad()
    def extend(self, tokens_T: torch.Tensor, features_TK: torch.Tensor) -> None:
        """Commit positions [length, length+T): features from the target, tokens one ahead."""
        T, start = len(tokens_T), self.length
        positions = torch.arange(start, start + T, device=self.device)

        def attend(q, k, v):
            self.k[:, :, start:start + T] = k
            self.v[:, :, start:start + T] = v
            allowed = torch.ones(T, start + T, dtype=torch.bool, device=self.device)
            allowed[:, start:] = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
            return attend_with_mask(q, self.k[:, :, :start + T], self.v[:, :, :start + T], allowed)

        h = self.first_hidden(features_TK.to(self.k.dtype))[None]
        out = self.head.step(tokens_T[None], h, positions[None], attend)[0]
        self.length += T
        self.h_last, self.logits_last = out[-1], self.head.logits(out[-1:])[0].float()

    def first_hidden(self, features_TK: torch.Tensor) -> torch.Tensor:
        """The hidden state a committed position's first step reads (kinds override)."""
        return features_TK

    def _step_static(self, tokens_F, h_FH, positions_F, write_at_F, allowed_FL):
        """Fixed shapes (frontier F, whole cache L): writes K/V at `write_at_F`, attends under
        `allowed_FL`. This is what CUDA graphs capture; every input is a tensor, nothing syncs."""
        def attend(q, k, v):
            self.k.index_copy_(2, write_at_F, k)
            self.v.index_copy_(2, write_at_F, v)
            return attend_with_mask(q, self.k, self.v, allowed_FL)

        out = self.head.step(tokens_F[None], h_FH[None], positions_F[None], attend)[0]
        return out, torch.log_softmax(self.head.logits(out).float(), -1)

    def _expand(self, tokens_F, h_FH, depth: int, num_tree: int, tree_allowed_FM):
        """One batched step for the frontier. Tree KV goes in the cache's scratch space right after
        the committed context, [length, length+num_tree+F), and is overwritten by the next extend."""
        F_, base = len(tokens_F), self.length + num_tree
        if base + F_ > self.max_len:
            raise ValueError(f"draft tree does not fit the runtime's max_len={self.max_len}")
        allowed = torch.zeros(F_, self.max_len, dtype=torch.bool, device=self.device)
        allowed[:, :self.length] = True
        allowed[:, self.length:base] = tree_allowed_FM
        allowed[:, base:base + F_] = torch.eye(F_, dtype=torch.bool, device=self.device)
        positions = torch.full((F_,), self.length - 1 + depth, device=self.device)
        write_at = torch.arange(base, base + F_, device=self.device)
        return self.step_fn(tokens_F, h_FH, positions, write_at, allowed)

    @torch.no_grad()
    def draft_tree(self, root: torch.Tensor) -> Tree:
        """EAGLE-2: expand the top-k frontier by cumulative log-prob `depth` times, rerank globally.
        With top_k 1 the tree is a chain, drafted without the frontier bookkeeping (same tree)."""
        if self.tree_cfg.top_k == 1:
            return self.draft_chain(root)
        return self.draft_dynamic(root)

    @torch.no_grad()
    def draft_chain(self, root: torch.Tensor) -> Tree:
        length = min(self.tree_cfg.depth, self.tree_cfg.num_nodes - 1)
        draft_id = self.logits_last.argmax(-1, keepdim=True)
        tokens, h = [self.head.to_target_ids(draft_id)], self.h_last[None]
        for depth in range(1, length):
            above = torch.ones(1, depth - 1, dtype=torch.bool, device=self.device)
            out, logp = self._expand(tokens[-1], h, depth, depth - 1, above)
            tokens.append(self.head.to_target_ids(logp.argmax(-1)))
            h = out
        return chain_tree(root, torch.cat(tokens))

    @torch.no_grad()
    def draft_dynamic(self, root: torch.Tensor) -> Tree:
        K, dev = self.tree_cfg.top_k, self.device
        logp = torch.log_softmax(self.logits_last, -1)
        score, draft_ids = torch.topk(logp, K)
        cand = {"tokens": [self.head.to_target_ids(draft_ids)], "parent": [torch.full((K,), -1, device=dev)],
                "score": [score], "depth": [torch.ones(K, dtype=torch.long, device=dev)]}
        frontier = torch.arange(K, device=dev)            # candidate indices
        frontier_h = self.h_last.expand(K, -1)
        anc = torch.zeros(K, 0, dtype=torch.bool, device=dev)  # frontier x expanded nodes: ancestry
        flat = lambda key: torch.cat(cand[key])  # noqa: E731
        for depth in range(1, self.tree_cfg.depth):
            out, logp = self._expand(flat("tokens")[frontier], frontier_h, depth, anc.shape[1], anc)
            child_score, child_ids = torch.topk(logp, K, dim=-1)                      # [K, K]
            total = flat("score")[frontier, None] + child_score
            base = sum(len(t) for t in cand["tokens"])
            cand["tokens"].append(self.head.to_target_ids(child_ids.flatten()))
            cand["parent"].append(frontier.repeat_interleave(K))
            cand["score"].append(total.flatten())
            cand["depth"].append(torch.full((K * K,), depth + 1, dtype=torch.long, device=dev))
            best = torch.topk(total.flatten(), K).indices
            # ancestors of the new frontier among expanded nodes: the parent's row plus the parent itself
            parent_slot = best // K
            eye = torch.eye(K, dtype=torch.bool, device=dev)
            anc = torch.cat([anc, eye], dim=1)[parent_slot]
            frontier, frontier_h = base + best, out[parent_slot]
        return assemble_tree(root, flat("tokens"), flat("parent"), flat("score"), flat("depth"), self.tree_cfg.num_nodes,
                             max_depth=self.tree_cfg.depth)
