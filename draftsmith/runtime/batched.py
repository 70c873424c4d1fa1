"""Batched speculative decoding: B sequences in lockstep over one static cache, each row with its
own committed length, its own draft tree (padded to the batch's largest) and its own accepted path,
verified in one target forward per round. Plain batched decoding is the same loop with one-node trees, built for the
whole batch at once; greedy verification checks every row's tree in one pass (`verify_greedy_rows`), so that neither
pays a host step per row; sampling does too over chains and plain decoding's roots (`verify_sampling_rows`), and row
by row over trees (their proposals differ per row).

Cache layout per round: every row's tree KV is written at one shared scratch offset S = max(lengths)
(the static cache writes all rows at the same slots); row b attends to its committed [0, length_b)
and to its own tree block [S, S+N), with RoPE positions length_b + depth. `commit` then copies each
row's accepted nodes from [S, S+N) down to [length_b, length_b + accepted_b). Rows that finished
keep their length and run a padding node until the last row is done (what a server's batch does
between a request's end and the next one's admission)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftsmith.heads.drafting import Commits
from draftsmith.heads.tree import Chains, Tree, chain_tree
from draftsmith.runtime.generate import _finish, _sync
from draftsmith.runtime.target import TargetRunner, layer_states
from draftsmith.runtime.verify import SamplingConfig, sample_token, verify, verify_greedy_rows, verify_sampling_rows


class BatchRunner(TargetRunner):
    """`TargetRunner` for B rows: per-row committed lengths on the host (`lengths`), one forward
    over [B, N] tokens with a [B, 1, N, max_len] mask."""

    def __init__(self, model, batch_size: int, max_len: int, layer_ids: list[int], compile_mode: str | None = "auto"):
        super().__init__(model, max_len, layer_ids, compile_mode)
        self.batch_size = batch_size
        self.lengths = [0] * batch_size
        self.scratch = 0

    def reset(self) -> None:
        super().reset()
        self.lengths = [0] * self.batch_size

    def _decode(self, tokens_BN, positions_BN, masks, last: bool = False):
        """`last` is not used: right-padded rows end at different positions, so every position's logits are made."""
        self.extractor._captured.clear()
        out = self.extractor.decoder(input_ids=tokens_BN, position_ids=positions_BN, attention_mask=masks,
                                     use_cache=True, **{self.cache_kwarg: self.cache})
        final = out.last_hidden_state
        aux = self.extractor.aux()
        return self.lm_head(final).float(), final if aux is None else aux, final

    @torch.no_grad()
    def forward(self, tokens_BN: torch.Tensor, depth_BN: torch.Tensor, tree_mask_BNN: torch.Tensor, fixed: bool = True):
        """Returns (logits_BNV fp32, features_BNK, final_BNH); tree KV sits at [scratch, scratch+N)."""
        N = tokens_BN.shape[1]
        self.scratch = max(self.lengths)
        if self.scratch + N > self.max_len:
            raise ValueError(f"sequence of {self.scratch + N} tokens exceeds the runtime's max_len={self.max_len}")
        self._set_length(self.scratch)
        positions = torch.tensor(self.lengths, device=self.device)[:, None] + depth_BN
        lengths = torch.tensor(self.lengths, device=self.device)
        return self._run(tokens_BN, positions, tree_mask_BNN, self._masks(tree_mask_BNN, lengths, self.scratch, depth_BN), fixed)

    def prefill_rows(self, prompts: list[torch.Tensor]):
        """Right-padded prompts in one forward (a recurrent target: `_run_rows`): per row (last logits_V, features_TK)."""
        if self.recurrent:
            logits, features = self._run_rows(prompts)
        else:
            T = max(len(p) for p in prompts)
            tokens = torch.zeros(self.batch_size, T, dtype=torch.long, device=self.device)
            for b, prompt in enumerate(prompts):
                tokens[b, :len(prompt)] = prompt
            causal = torch.ones(T, T, dtype=torch.bool, device=self.device).tril().expand(self.batch_size, T, T)
            depth = torch.arange(T, device=self.device).expand(self.batch_size, T)
            logits, features, _ = self.forward(tokens, depth, causal, fixed=False)
            self.commit_rows([torch.arange(len(p), device=self.device) for p in prompts])
        return [logits[b, len(p) - 1] for b, p in enumerate(prompts)], [features[b, :len(p)] for b, p in enumerate(prompts)]

    def commit_rows(self, paths: list[torch.Tensor]) -> None:
        """Row b keeps the KV of `paths[b]` (indices into the last forward's N nodes; may be empty); on a
        recurrent target, the states after its last kept node (`_keep_states`)."""
        self.commit_padded(pad_paths(paths, self.device), [len(p) for p in paths])

    def commit_padded(self, paths_BA: torch.Tensor, counts: list[int]) -> None:
        """`commit_rows` with the paths as one tensor: row b keeps the nodes paths_BA[b, :counts[b]] (the rest of the
        row, any node indices, lands past its new length and is never read)."""
        if self.recurrent:
            self._keep_states(counts)
        self._commit_kv(paths_BA, counts)

    def _commit_kv(self, paths_BA: torch.Tensor, counts: list[int]) -> None:
        """Copy each row's kept nodes from the scratch block down to its committed length."""
        A = max(counts)
        if A == 0:
            return
        src = paths_BA[:, :A] + self.scratch
        dst = torch.tensor(self.lengths, device=self.device)[:, None] + torch.arange(A, device=self.device)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None:  # recurrent and MLP-only layers keep no KV
                continue
            for cache in (layer.keys, layer.values):
                H, D = cache.shape[1], cache.shape[3]
                kept = cache.gather(2, src[:, None, :, None].expand(-1, H, -1, D))
                cache.scatter_(2, dst[:, None, :, None].expand(-1, H, -1, D), kept)
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]

    def _run_rows(self, chains: list[torch.Tensor]):
        """Run row b over `chains[b]` from its current state and commit exactly those tokens: a recurrent
        state cannot skip padding, so the rows go in segments that end at each distinct chain length, and a
        row's states are kept as its chain ends (later segments run it on padding, then it gets them back).
        Returns [B, longest] logits and features (row b's valid up to its length)."""
        lengths = [len(c) for c in chains]
        tokens = torch.zeros(self.batch_size, max(lengths), dtype=torch.long, device=self.device)
        for b, chain in enumerate(chains):
            tokens[b, :len(chain)] = chain
        kept, outputs, start = {0: self._all_states()}, [], 0
        for end in sorted(set(lengths) - {0}):
            n = end - start
            causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril().expand(self.batch_size, n, n)
            depth = torch.arange(n, device=self.device).expand(self.batch_size, n)
            logits, features, _ = self.forward(tokens[:, start:end], depth, causal, fixed=False)
            self._snapshot = None
            outputs.append((logits, features))
            arange = torch.arange(n, device=self.device)
            kept_now = [n if length >= end else 0 for length in lengths]
            self._commit_kv(arange.expand(self.batch_size, n), kept_now)
            kept[end] = self._all_states()
            start = end
        for i, layer in self.recurrent.items():
            self._select_rows(layer, {length: states[i] for length, states in kept.items()}, lengths)
        return torch.cat([o[0] for o in outputs], 1), torch.cat([o[1] for o in outputs], 1)

    def _all_states(self) -> dict:
        return {i: layer_states(layer) for i, layer in self.recurrent.items()}


@dataclass
class BatchResult:
    tokens: list[list[int]]
    seconds: float
    ttft_seconds: float                       # batched prefill + every row's first token
    finish_seconds: list[float] = field(default_factory=list)   # per row: when its last token came
    accept_lengths: list[list[int]] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    num_rounds: int = 0                       # draft + verify rounds (one per batch step)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def tpot_seconds(self) -> float:
        """Mean time per output token after the first, over rows."""
        per_row = [(f - self.ttft_seconds) / (len(t) - 1) for f, t in zip(self.finish_seconds, self.tokens) if len(t) > 1]
        return sum(per_row) / len(per_row) if per_row else 0.0


def batch_max_len(prompts: list[torch.Tensor], max_new_tokens: int, num_nodes: int) -> int:
    """Cache length a batch needs: a row commits up to num_nodes - 1 tokens past max_new_tokens in its
    last round and keeps them while idle, and the next tree sits past the longest row."""
    return max(len(p) for p in prompts) + max_new_tokens + 2 * num_nodes + 1


def pad_trees(trees: list[Tree], device, num_nodes: int = 1):
    """(tokens, depths [B, N], ancestor masks [B, N, N], parents [B, N], tree sizes [B]), N = max(num_nodes, largest
    tree); padding nodes see only themselves."""
    N = max([num_nodes] + [len(t) for t in trees])
    tokens = torch.zeros(len(trees), N, dtype=torch.long, device=device)
    depth = torch.zeros(len(trees), N, dtype=torch.long, device=device)
    parent = torch.full((len(trees), N), -1, dtype=torch.long, device=device)
    mask = torch.eye(N, dtype=torch.bool, device=device).repeat(len(trees), 1, 1)
    for b, tree in enumerate(trees):
        n = len(tree)
        tokens[b, :n], depth[b, :n], mask[b, :n, :n], parent[b, :n] = tree.tokens_N, tree.depth_N, tree.mask_NN, tree.parent_N
    return tokens, depth, mask, parent, torch.tensor([len(t) for t in trees], device=device)


def pad_chains(tokens_BN: torch.Tensor, done: list[bool], num_nodes: int = 1):
    """`pad_trees` of every row's chain [root, drafts] (`Chains.tokens_BN`), built for the batch at once; a finished
    row's tree is its root alone (what it verifies; the nodes after it are not read)."""
    B, K1 = tokens_BN.shape
    N, device = max(num_nodes, K1), tokens_BN.device
    nodes = torch.arange(N, device=device)
    inside = nodes < K1
    tokens = torch.zeros(B, N, dtype=torch.long, device=device)
    tokens[:, :K1] = tokens_BN
    depth = torch.where(inside, nodes, 0).expand(B, N)
    parent = torch.where(inside, nodes - 1, -1).expand(B, N)
    mask = torch.eye(N, dtype=torch.bool, device=device)
    mask[:K1, :K1] = torch.ones(K1, K1, dtype=torch.bool, device=device).tril()
    sizes = torch.where(torch.tensor(done, device=device), 1, K1)
    return tokens, depth, mask.expand(B, N, N), parent, sizes


def root_nodes(roots_B: torch.Tensor):
    """`pad_trees` of one-node trees (plain decoding's round), built for the batch at once."""
    B, device = len(roots_B), roots_B.device
    return (roots_B[:, None], torch.zeros(B, 1, dtype=torch.long, device=device), torch.ones(B, 1, 1, dtype=torch.bool, device=device),
            torch.full((B, 1), -1, dtype=torch.long, device=device), torch.ones(B, dtype=torch.long, device=device))


def pad_paths(paths: list[torch.Tensor], device) -> torch.Tensor:
    """[B, A] node indices, row b's path left-aligned and its tail repeating the path's last node (0 when empty)."""
    src = torch.zeros(len(paths), max([len(p) for p in paths] + [1]), dtype=torch.long, device=device)
    for b, path in enumerate(paths):
        if len(path):
            src[b, :len(path)] = path
            src[b, len(path):] = path[-1]
    return src


def _chains_at_once(sampling: SamplingConfig) -> bool:
    """Whether chains are verified for every row in one pass: greedy, or exact sampling (typical acceptance reads trees)."""
    return sampling.greedy or sampling.acceptance != "typical"


def _verdicts(padded, trees: list[Tree] | None, logits_BNV, sampling, gen, done: list[bool]):
    """(accepted node paths [B, A], counts [B] list, bonus tokens [B]) of a round over the `pad_trees` of `trees` (None:
    plain decoding's one-node trees, or chains padded by `pad_chains`); finished rows keep nothing. Greedy verifies every
    row in one pass (`verify_greedy_rows`), and so does exact sampling over chains (`verify_sampling_rows`: their drafts
    are deterministic); trees are sampled row by row (`verify`, which reads a tree's proposals), and so is typical
    acceptance."""
    tokens, depth, mask, parent, sizes = padded
    if sampling.greedy or (trees is None and _chains_at_once(sampling)):
        paths, counts, bonus = verify_greedy_rows(tokens, parent, depth, mask, sizes, logits_BNV) if sampling.greedy \
            else verify_sampling_rows(tokens, sizes, logits_BNV, sampling, gen)
        return paths, [0 if d else c for c, d in zip(counts.tolist(), done)], bonus
    trees = trees or [chain_tree(root, root.view(1)[:0]) for root in tokens[:, 0]]
    verdicts = [None if done[b] else verify(tree, logits_BNV[b, :len(tree)], sampling, gen) for b, tree in enumerate(trees)]
    bonus = torch.stack([tokens[b, 0] if v is None else v[1] for b, v in enumerate(verdicts)])
    paths = [tokens.new_zeros(0) if v is None else v[0] for v in verdicts]
    return pad_paths(paths, tokens.device), [len(p) for p in paths], bonus


def _start_drafter(drafter, prompts, roots, features, sampling, gen) -> None:
    drafter.reset()
    if hasattr(drafter, "set_sampling"):
        drafter.set_sampling(0.0 if sampling.greedy else sampling.temperature, gen)
    rows = list(range(len(prompts)))
    if hasattr(drafter, "begin_rows"):  # drafters that read the whole prompt (baselines): extend never carries prompt[0]
        drafter.begin_rows(rows, prompts)
    tokens = [torch.cat([p[1:], r.view(1)]) for p, r in zip(prompts, roots)]
    drafter.commit(Commits.from_rows(rows, tokens, features, len(prompts)))


@torch.no_grad()
def batched_generate(target: BatchRunner, prompts: list[torch.Tensor], max_new_tokens: int, sampling: SamplingConfig,
                     eos_ids: set[int], drafter=None, gen: torch.Generator | None = None) -> BatchResult:
    """Decode every prompt in one batch; with a batched `drafter` (heads/drafting.py, batch_size = B)
    speculatively: one draft call per round for every row, one verify forward. Greedy output of each
    row equals plain greedy decoding of that prompt alone, token for token."""
    if len(prompts) != target.batch_size or (drafter is not None and drafter.batch_size != len(prompts)):
        raise ValueError(f"{len(prompts)} prompts for a batch of {target.batch_size} rows "
                         f"(drafter for {'no' if drafter is None else drafter.batch_size} rows)")
    _sync(target.device)
    start = time.perf_counter()
    target.reset()
    logits, features = target.prefill_rows(prompts)
    roots = [sample_token(row, sampling, gen) for row in logits]
    if drafter is not None:
        _start_drafter(drafter, prompts, roots, features, sampling, gen)
    state = [_finish([], [int(root)], eos_ids, max_new_tokens) for root in roots]
    tokens, done = [s[0] for s in state], [s[1] for s in state]
    _sync(target.device)
    ttft = time.perf_counter() - start
    result = BatchResult(tokens, 0.0, ttft, [ttft] * len(prompts), [[] for _ in prompts])
    # one verify shape per run (CUDA graphs capture fixed shapes), even when drafts come up short
    num_nodes = drafter.tree_cfg.num_nodes if drafter is not None else 1
    roots = torch.stack(roots)
    while not all(done):
        t0 = time.perf_counter()
        if drafter is None:
            trees, padded = None, root_nodes(roots)
        else:
            drafted = drafter.draft_trees(roots)
            if isinstance(drafted, Chains) and _chains_at_once(sampling):  # every row's chain at once (no tree is read)
                trees, padded = None, pad_chains(drafted.tokens_BN, done, num_nodes)
            else:
                trees = [chain_tree(root, root.view(1)[:0]) if done[b] else drafted[b] for b, root in enumerate(roots)]
                padded = pad_trees(trees, target.device, num_nodes)
        t1 = time.perf_counter()
        logits, features, _ = target.forward(*padded[:3])
        paths, counts, bonus = _verdicts(padded, trees, logits, sampling, gen, done)
        target.commit_padded(paths, counts)
        result.draft_seconds += t1 - t0
        result.verify_seconds += time.perf_counter() - t1
        result.num_rounds += 1
        # row b's committed tokens: its accepted drafts, then the bonus token
        kept = torch.cat([padded[0].gather(1, paths)[:, 1:], bonus[:, None]], dim=1)
        kept.scatter_(1, (torch.tensor(counts, device=kept.device) - 1).clamp(min=0)[:, None], bonus[:, None])
        kept_rows, was_done = kept.tolist(), list(done)
        for b, n in enumerate(counts):
            if not was_done[b]:
                result.accept_lengths[b].append(n - 1)
                tokens[b], done[b] = _finish(tokens[b], kept_rows[b][:n], eos_ids, max_new_tokens)
                result.finish_seconds[b] = time.perf_counter() - start
        roots = torch.where(torch.tensor(was_done, device=roots.device), roots, bonus)
        extending = [0 if d else n for n, d in zip(counts, done)]
        if drafter is not None and any(extending):  # committing is the draft's work too: every row in one gather
            t2 = time.perf_counter()
            width = max(extending)
            feats = features.gather(1, paths[:, :width, None].expand(-1, -1, features.shape[-1]))
            drafter.commit(Commits(kept[:, :width], feats, extending))
            result.draft_seconds += time.perf_counter() - t2
    _sync(target.device)
    result.seconds = time.perf_counter() - start
    return result
