"""Baseline drafters, run by the same runtime as the trained heads so that their tau, cost ratio c,
speedup and $/Mtok sit next to the heads' in one report:

- `NgramDrafter`: prompt lookup (model-free). The longest suffix of the context (max_ngram tokens
  down to min_ngram) that occurred earlier proposes the K tokens that followed its most recent
  earlier occurrence; no match proposes nothing (the round decodes one token).
- `DraftModelDrafter`: a small independent causal LM sharing the target's tokenizer (any Hugging
  Face model; the demo's is built by `draftsmith target`) drafts a greedy chain of K tokens over a
  static cache of its own, rolled back to the committed context after each round.

Both implement the batched drafter interface (heads/drafting.py) plus `begin_rows(rows, prompts)`,
since they read the prompt's first token, which `extend` never carries."""
from __future__ import annotations

import torch

from draftsmith.heads.drafting import BatchOfOne, Commits, TreeConfig
from draftsmith.heads.tree import Tree, chain_tree


def chain_config(k: int) -> TreeConfig:
    """K speculative tokens as one chain (vLLM's `num_speculative_tokens`; Medusa's choices [[0], [0, 0], ...])."""
    return TreeConfig(depth=k, top_k=1, num_nodes=k + 1, choices=[[0] * d for d in range(1, k + 1)] or None)


class _RowContexts(BatchOfOne):
    """Each row's committed token ids on the host: the prompt's first token, then what extend carries."""

    def _clear(self) -> None:
        self.contexts: list[list[int]] = [[] for _ in range(self.batch_size)]

    def begin_rows(self, rows: list[int], prompts: list[torch.Tensor]) -> None:
        for r, prompt in zip(rows, prompts):
            self.contexts[r] = prompt[:1].tolist()

    def commit(self, commits: Commits) -> None:
        tokens = commits.tokens_BT.tolist()
        for r, n in enumerate(commits.counts):
            self.contexts[r] += tokens[r][:n]


class NgramDrafter(_RowContexts):
    """Prompt lookup for B rows: each row's context on the host, looked up row by row (no model to batch)."""

    def __init__(self, k: int, max_ngram: int = 3, min_ngram: int = 1, batch_size: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"economics.ngram_min={min_ngram}, ngram_max={max_ngram}: expected 1 <= min <= max")
        self.tree_cfg, self.max_ngram, self.min_ngram, self.batch_size = chain_config(k), max_ngram, min_ngram, batch_size
        self._clear()

    @property
    def context(self) -> list[int]:
        return self.contexts[0]

    def reset(self) -> None:
        self._clear()

    def lookup(self, row: int = 0) -> list[int]:
        """The continuation of the longest earlier match of the row's context suffix (ends with the root)."""
        ctx, k = self.contexts[row], self.tree_cfg.depth
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            suffix = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start:start + n] == suffix:
                    return ctx[start + n:start + n + k]
        return []

    def draft_trees(self, roots_B: torch.Tensor) -> list[Tree]:
        out = []
        for b, root in enumerate(roots_B):
            proposal = self.lookup(b) if self.tree_cfg.depth > 0 else []
            out.append(chain_tree(root, torch.tensor(proposal, dtype=torch.long, device=root.device)))
        return out


class DraftModelDrafter(_RowContexts):
    """A small causal LM drafting B rows in lockstep over a static cache of its own (runtime/batched.py's
    BatchRunner): one forward feeds every row what its cache lacks, then K-1 batched single-token steps."""

    def __init__(self, model, max_len: int, k: int, batch_size: int = 1):
        from draftsmith.runtime.batched import BatchRunner
        self.tree_cfg, self.batch_size = chain_config(k), batch_size
        self.runner = BatchRunner(model, batch_size, max_len + k + 2, [])
        self._clear()

    def reset(self) -> None:
        self.runner.reset()
        self._clear()

    @torch.no_grad()
    def draft_trees(self, roots_B: torch.Tensor) -> list[Tree]:
        """Feed each row what its draft cache lacks (the last round's accepted tokens and the root) in one
        forward, then K-1 single-token steps for all rows; the drafted tokens' KV is dropped afterwards."""
        k, runner, device = self.tree_cfg.depth, self.runner, roots_B.device
        if k == 0:
            return [chain_tree(root, root.view(1)[:0]) for root in roots_B]
        # at least the root is fed to every row (drafting twice in a row re-feeds it)
        runner.lengths = [min(n, len(c) - 1) for n, c in zip(runner.lengths, self.contexts)]
        pending = [torch.tensor(c[n:], dtype=torch.long, device=device) for c, n in zip(self.contexts, runner.lengths)]
        P = max(len(p) for p in pending)
        tokens = torch.zeros(self.batch_size, P, dtype=torch.long, device=device)
        for b, row in enumerate(pending):
            tokens[b, :len(row)] = row
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril().expand(self.batch_size, P, P)
        logits, _, _ = runner.forward(tokens, torch.arange(P, device=device).expand(self.batch_size, P), causal, fixed=False)
        runner.commit_rows([torch.arange(len(p), device=device) for p in pending])
        committed = list(runner.lengths)
        last = torch.tensor([len(p) - 1 for p in pending], device=device)
        drafts = [logits[torch.arange(self.batch_size, device=device), last].argmax(-1)]
        zero = torch.zeros(self.batch_size, 1, dtype=torch.long, device=device)
        one = torch.ones(self.batch_size, 1, 1, dtype=torch.bool, device=device)
        for _ in range(k - 1):
            logits, _, _ = runner.forward(drafts[-1][:, None], zero, one)
            runner.commit_rows([zero[0]] * self.batch_size)
            drafts.append(logits[:, 0].argmax(-1))
        runner.lengths = committed
        drafted = torch.stack(drafts, 1)
        return [chain_tree(root, drafted[b]) for b, root in enumerate(roots_B)]


def check_shared_tokenizer(target_tokenizer, draft_tokenizer, where: str) -> None:
    """A draft model proposes target token ids: its vocabulary must be the target's, id for id."""
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(f"{where}: this draft model's tokenizer differs from the target's "
                         f"({len(draft_tokenizer)} vs {len(target_tokenizer)} tokens); a draft model must share the target's vocabulary")
