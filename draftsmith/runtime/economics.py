"""The economics of a draft head: the low-batch walltime model of Leviathan et al. (2023, Theorem
3.8), the break-even draft cost, cost per output token, and vLLM's K-per-batch-size schedule.

    tau(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha)      expected tokens per target forward
    walltime factor   = tau / (gamma * c + 1)                     c = draft step / target step latency
    c*                = (tau - 1) / gamma                         the c at which speculation stops paying
    $/1M tokens       = $/h * 1e6 / (tokens/s * 3600)
    a throughput multiplier M pays while the extra $/h < baseline $/h * (M - 1)

Pure functions: validation (the low-batch screen) and the economics sweep both use them."""
from __future__ import annotations


def expected_tokens(alpha: float, gamma: int) -> float:
    """tau for i.i.d. acceptance rate alpha and gamma drafted tokens (bonus token included)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def alpha_from_tau(tau: float, gamma: int, tolerance: float = 1e-10) -> float:
    """The i.i.d. acceptance rate whose expected_tokens equals a measured tau (bisection; monotone);
    0 for tau <= 1 (nothing accepted, or no rounds at all)."""
    if tau <= 1.0:
        return 0.0
    if tau >= gamma + 1:
        return 1.0
    low, high = 0.0, 1.0
    while high - low > tolerance:
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens(mid, gamma) < tau else (low, mid)
    return (low + high) / 2


def walltime_factor(tau: float, gamma: int, c: float) -> float:
    """Theorem 3.8's expected improvement factor in walltime (low batch, memory-bound target)."""
    return tau / (gamma * c + 1)


def break_even_cost(tau: float, gamma: int) -> float:
    """c* = (tau - 1) / gamma: a draft step cheaper than this fraction of a target step pays."""
    return (tau - 1) / gamma


def usd_per_million_tokens(usd_per_hour: float, tokens_per_s: float) -> float:
    if tokens_per_s <= 0:
        raise ValueError(f"tokens_per_s={tokens_per_s}: expected a positive throughput")
    return usd_per_hour * 1e6 / (tokens_per_s * 3600)


def break_even_extra_usd_per_hour(baseline_usd_per_hour: float, multiplier: float) -> float:
    """The extra $/h (e.g. hardware for a drafter) a throughput multiplier M can carry before it loses."""
    return baseline_usd_per_hour * (multiplier - 1)


def schedule(sweep: dict[int, dict[int, float]]) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` ([[start_bs, end_bs, K], ...], K = 0: no drafting)
    from a sweep {batch_size: {K: output tokens/s}}: the best K per measured batch size, ranges merged;
    each range runs up to the batch size before the next measured one."""
    sizes = sorted(sweep)
    if not sizes:
        raise ValueError("empty sweep: no batch size was measured")
    best = [max(sorted(sweep[b]), key=lambda k: (sweep[b][k], -k)) for b in sizes]
    out = []
    for i, (size, k) in enumerate(zip(sizes, best)):
        end = sizes[i + 1] - 1 if i + 1 < len(sizes) else size
        if out and out[-1][2] == k:
            out[-1][1] = end
        else:
            out.append([size, end, k])
    return out


def low_batch_screen(tau: float, gamma: int, c: float, measured_factor: float, acceptance_per_depth: list[float]) -> dict:
    """What validation reports for one head at batch size 1: the alpha that explains tau under the
    i.i.d. model, Theorem 3.8's prediction next to the measured walltime factor, and c*."""
    alpha = alpha_from_tau(tau, gamma)
    return {"gamma": gamma, "tau": tau, "c": c, "alpha_iid": alpha, "alpha_per_depth": acceptance_per_depth,
            "predicted_walltime_factor": walltime_factor(tau, gamma, c), "measured_walltime_factor": measured_factor,
            "break_even_c": break_even_cost(tau, gamma), "pays": c < break_even_cost(tau, gamma)}


def depth_speedups(acceptance_per_depth: list[float], c: float, verify_cost: list[float]) -> dict[int, float]:
    """Predicted speedup over plain decoding of a chain of each depth d <= len(acceptance_per_depth):

        E[d]   = 1 + sum_{k<=d} prod_{i<=k} alpha_i     tokens per round (conditional acceptance per depth)
        cost   = d * c + v(d + 1)                       a round, in plain decode steps (v: verifying n tokens)

    `verify_cost[n - 1]` is v(n), measured on the device: on a GPU it stays near 1 for a few tokens, on a CPU
    it grows with n, which is what makes a long chain lose there. Depth 0 is plain decoding (1.0)."""
    out, expected, reach = {0: 1.0}, 1.0, 1.0
    for d, alpha in enumerate(acceptance_per_depth[:len(verify_cost) - 1], 1):
        reach *= alpha
        expected += reach
        out[d] = expected / (d * c + verify_cost[d])
    return out
