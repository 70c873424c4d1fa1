"""Decoding loops over the static-cache target: plain (one token per forward) and speculative
(draft a tree, verify it in one forward, commit the accepted path, extend the draft)."""
from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from draftsmith.heads.tree import Tree
from draftsmith.runtime.verify import SamplingConfig, sample_token, verify


@dataclass
class GenerationResult:
    tokens: list[int]
    seconds: float
    accept_lengths: list[int] = field(default_factory=list)  # accepted draft tokens per round (bonus excluded)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def num_forwards(self) -> int:
        return len(self.accept_lengths)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _finish(tokens: list[int], new: list[int], eos_ids: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Append new tokens, stopping after an EOS or at the token limit, even inside an accepted block."""
    for token in new:
        if len(tokens) >= max_new_tokens:
            return tokens, True
        tokens.append(token)
        if token in eos_ids:
            return tokens, True
    return tokens, len(tokens) >= max_new_tokens


@torch.no_grad()
def plain_generate(target, prompt_T: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig,
                   eos_ids: set[int], gen: torch.Generator | None = None, image_inputs: dict | None = None) -> GenerationResult:
    """The baseline: same runtime, same static cache, one token per target forward. `image_inputs`: an image
    prompt's pixel inputs (`TargetRunner.prefill`)."""
    _sync(target.device)
    start = time.perf_counter()
    target.reset()
    logits, _, _ = target.prefill(prompt_T, image_inputs)
    token = sample_token(logits[-1], sampling, gen)
    tokens, done = _finish([], [int(token)], eos_ids, max_new_tokens)
    one = torch.ones(1, 1, dtype=torch.bool, device=target.device)
    zero = torch.zeros(1, dtype=torch.long, device=target.device)
    while not done:
        logits, _, _ = target.forward(token.view(1), zero, one)
        target.commit(zero)
        token = sample_token(logits[-1], sampling, gen)
        tokens, done = _finish(tokens, [int(token)], eos_ids, max_new_tokens)
    _sync(target.device)
    return GenerationResult(tokens, time.perf_counter() - start)


@torch.no_grad()
def speculative_generate(target, drafter, prompt_T: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig,
                         eos_ids: set[int], gen: torch.Generator | None = None, image_inputs: dict | None = None) -> GenerationResult:
    """Tree-verified speculative decoding; greedy output equals plain greedy decoding token for token. An image
    prompt's target prefill reads its images; the head reads the target's features there, as engines run it."""
    _sync(target.device)
    start = time.perf_counter()
    target.reset()
    drafter.reset()
    if hasattr(drafter, "set_sampling"):  # drafters that sample their drafts (proposals for verification)
        drafter.set_sampling(0.0 if sampling.greedy else sampling.temperature, gen)
    if hasattr(drafter, "begin"):  # drafters that read the whole prompt (baselines): extend never carries prompt[0]
        drafter.begin(prompt_T)
    logits, features, _ = target.prefill(prompt_T, image_inputs)
    root = sample_token(logits[-1], sampling, gen)
    drafter.extend(torch.cat([prompt_T[1:], root.view(1)]), features)
    tokens, done = _finish([], [int(root)], eos_ids, max_new_tokens)
    result = GenerationResult(tokens, 0.0)
    while not done:
        t0 = time.perf_counter()
        tree: Tree = drafter.draft_tree(root)
        t1 = time.perf_counter()
        logits, features, _ = target.forward(tree.tokens_N, tree.depth_N, tree.mask_NN)
        path, bonus = verify(tree, logits, sampling, gen)
        target.commit(path)
        accepted = tree.tokens_N[path[1:]]
        result.verify_seconds += time.perf_counter() - t1
        result.draft_seconds += t1 - t0
        result.accept_lengths.append(len(path) - 1)
        tokens, done = _finish(tokens, accepted.tolist() + [int(bonus)], eos_ids, max_new_tokens)
        if not done:  # committing is the draft's work too (EAGLE's first step, a parallel drafter's whole forward)
            t2 = time.perf_counter()
            drafter.extend(torch.cat([accepted, bonus.view(1)]), features[path])
            result.draft_seconds += time.perf_counter() - t2
            root = bonus
    _sync(target.device)
    result.seconds = time.perf_counter() - start
    return result


def acceptance_stats(accept_lengths: list[int], depth: int) -> dict:
    """tau includes the bonus token; alpha_d is conditional: P(accept >= d | accept >= d-1)."""
    counts = Counter(accept_lengths)
    rounds = max(len(accept_lengths), 1)
    alpha = []
    for d in range(1, depth + 1):
        reached = sum(c for k, c in counts.items() if k >= d - 1)
        passed = sum(c for k, c in counts.items() if k >= d)
        alpha.append(passed / reached if reached else 0.0)
    return {"tau": sum(a + 1 for a in accept_lengths) / rounds, "num_rounds": len(accept_lengths),
            "acceptance_per_depth": alpha, "accept_length_histogram": {str(k): counts.get(k, 0) for k in range(depth + 1)}}


def output_digest(tokens: list[int]) -> str:
    """What validation records of one prompt's greedy output (`output_sha256`), and `draftsmith check` compares."""
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
