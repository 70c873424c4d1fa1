"""Baseline drafters, run by the same runtime as the trained heads so that their tau, cost ratio c,
speedup and $/Mtok sit next to the heads' in one report:

- `NgramDrafter`: prompt lookup (model-free). The longest suffix of the context (max_ngram tokens
  down to min_ngram) that occurred earlier proposes the K tokens that followed its most recent
  earlier occurrence; no match proposes nothing (the round decodes one token).
- `DraftModelDrafter`: a small independent causal LM sharing the target's tokenizer (any Hugging
  Face model; the demo's is built by `draftsmith target`) drafts a greedy chain of K tokens over a
  static cache of its own, rolled back to the committed context after each round.

Both implement the drafter interface (heads/drafting.py) plus `begin(prompt)`, since they read
the prompt's first token, which `extend` never carries."""
from __future__ import annotations

import torch

from draftsmith.heads.drafting import TreeConfig
from draftsmith.heads.tree import Tree, chain_tree
from draftsmith.runtime.target import TargetRunner


def chain_config(k: int) -> TreeConfig:
    """K speculative tokens as one chain (vLLM's `num_speculative_tokens`; Medusa's choices [[0], [0, 0], ...])."""
    return TreeConfig(depth=k, top_k=1, num_nodes=k + 1, choices=[[0] * d for d in range(1, k + 1)] or None)


class NgramDrafter:
    def __init__(self, k: int, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"economics.ngram_min={min_ngram}, ngram_max={max_ngram}: expected 1 <= min <= max")
        self.tree_cfg, self.max_ngram, self.min_ngram = chain_config(k), max_ngram, min_ngram
        self.context: list[int] = []

    def reset(self) -> None:
        self.context = []

    def begin(self, prompt_T: torch.Tensor) -> None:
        self.context = prompt_T[:1].tolist()

    def extend(self, tokens_T: torch.Tensor, features_TK=None) -> None:
        self.context += tokens_T.tolist()

    def lookup(self) -> list[int]:
        """The continuation of the longest earlier match of the context's suffix (ends with the root)."""
        ctx, k = self.context, self.tree_cfg.depth
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            suffix = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start:start + n] == suffix:
                    return ctx[start + n:start + n + k]
        return []

    def draft_tree(self, root: torch.Tensor) -> Tree:
        proposal = self.lookup() if self.tree_cfg.depth > 0 else []
        return chain_tree(root, torch.tensor(proposal, dtype=torch.long, device=root.device))


class DraftModelDrafter:
    def __init__(self, model, max_len: int, k: int):
        self.tree_cfg = chain_config(k)
        self.runner = TargetRunner(model, max_len, [])
        self.context: list[int] = []

    def reset(self) -> None:
        self.runner.reset()
        self.context = []

    def begin(self, prompt_T: torch.Tensor) -> None:
        self.context = prompt_T[:1].tolist()

    def extend(self, tokens_T: torch.Tensor, features_TK=None) -> None:
        self.context += tokens_T.tolist()

    @torch.no_grad()
    def draft_tree(self, root: torch.Tensor) -> Tree:
        """Feed what the draft cache lacks (the last round's accepted tokens and the root) in one
        forward, then K-1 single-token steps; the drafted tokens' KV is dropped afterwards."""
        k, runner, device = self.tree_cfg.depth, self.runner, root.device
        if k == 0:
            return chain_tree(root, root.view(1)[:0])
        runner.truncate(min(runner.length, len(self.context) - 1))  # at least the root is fed (drafting twice in a row)
        pending = torch.tensor(self.context[runner.length:], dtype=torch.long, device=device)
        P = len(pending)
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        logits, _, _ = runner.forward(pending, torch.arange(P, device=device), causal, fixed=False)
        runner.commit(torch.arange(P, device=device))
        committed = runner.length
        drafts = [logits[-1].argmax(-1)]
        one = torch.ones(1, 1, dtype=torch.bool, device=device)
        zero = torch.zeros(1, dtype=torch.long, device=device)
        for _ in range(k - 1):
            logits, _, _ = runner.forward(drafts[-1].view(1), zero, one)
            runner.commit(zero)
            drafts.append(logits[-1].argmax(-1))
        runner.truncate(committed)
        return chain_tree(root, torch.stack(drafts))


def check_shared_tokenizer(target_tokenizer, draft_tokenizer, where: str) -> None:
    """A draft model proposes target token ids: its vocabulary must be the target's, id for id."""
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(f"{where}: this draft model's tokenizer differs from the target's "
                         f"({len(draft_tokenizer)} vs {len(target_tokenizer)} tokens); a draft model must share the target's vocabulary")
