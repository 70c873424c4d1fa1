"""The latency ratio the runtime reports: one draft step against one plain target decode step (the cost
ratio c), a draft step being a drafting round's work (commit a position, draft the tree) over its depth, so that
γ·c is a round's drafting cost for every kind (a parallel drafter does its one forward when it commits). HF `generate`'s time comes with its reference output (`validate.generate_reference`)."""
from __future__ import annotations

import time

import torch


def draft_step_cost(drafter, target, prompt: torch.Tensor, repeats: int = 5) -> float:
    """Seconds of one drafting round per drafted token over the seconds of one plain target decode step."""
    target.reset()
    drafter.reset()
    _, features, _ = target.prefill(prompt)
    drafter.extend(prompt[1:], features[:-1])
    drafter.draft_tree(prompt[-1])  # warm-up: a baseline's first draft reads the whole prompt
    start = time.perf_counter()
    for _ in range(repeats):
        drafter.extend(prompt[-1:], features[-1:])
        drafter.draft_tree(prompt[-1])
    per_draft_step = (time.perf_counter() - start) / repeats / max(drafter.tree_cfg.depth, 1)
    one = torch.ones(1, 1, dtype=torch.bool, device=target.device)
    zero = torch.zeros(1, dtype=torch.long, device=target.device)
    start = time.perf_counter()
    for _ in range(repeats):
        target.forward(prompt[-1:], zero, one)
    return per_draft_step / ((time.perf_counter() - start) / repeats)


def verify_costs(target, prompt: torch.Tensor, max_tokens: int, repeats: int = 5) -> list[float]:
    """v(n) for n = 1..max_tokens: seconds of one target forward verifying a chain of n tokens after `prompt`,
    over one plain decode step (v(1) = 1); the fastest of `repeats` forwards each, which a busy host disturbs least."""
    target.reset()
    target.prefill(prompt)
    seconds = []
    for n in range(1, max_tokens + 1):
        tokens = prompt[-1:].repeat(n)
        depth = torch.arange(n, device=target.device)
        chain = torch.ones(n, n, dtype=torch.bool, device=target.device).tril()
        target.forward(tokens, depth, chain)  # warm-up of this shape
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            target.forward(tokens, depth, chain)
            runs.append(time.perf_counter() - start)
        seconds.append(min(runs))
    return [s / seconds[0] for s in seconds]
