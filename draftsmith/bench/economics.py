"""`make bench` section `economics`: `draftsmith economics` on the demo recipe, and its batched sweep beside
the row-by-row one it replaced."""
from __future__ import annotations

import json


def bench_economics(recipe) -> dict:
    """`draftsmith economics` on the demo recipe (its `economics` section: the EAGLE-3 head, the n-gram and
    draft-model baselines, batch sizes 1..64); an economics.json current for these weights and settings is reused."""
    from draftsmith.runtime.sweep import economics_dir, economics_is_current, run_economics
    if not economics_is_current(recipe):
        run_economics(recipe)
    return json.loads((economics_dir(recipe) / "economics.json").read_text())



def render_economics(r: dict) -> list[str]:
    from draftsmith.runtime.economics_report import drafters_table, throughput_table
    e = r.get("economics")
    if not e:
        return []
    return ["## Economics across load (issue #14)", "",
            f"`draftsmith economics` on the demo recipe, {e['date']}, {e['machine']} ({e['dtype']}): the EAGLE-3 head next to "
            f"prompt-lookup n-gram and a 2-layer draft model built by the target stage; {e['num_prompts']} held-out prompts, "
            f"{e['max_new_tokens']} new tokens per row, greedy, K = speculative tokens per row (one chain), "
            f"${e['gpu_hour_usd']}/h as the price in the cost columns (an illustration: this CPU has no GPU-hour price).", ""] + \
        drafters_table(e) + ["", "Output tokens/s at the best K per batch size (K; TPOT ms / TTFT ms), and $/1M output tokens:", ""] + \
        throughput_table(e) + [""] + _batched_against_row_by_row(r) + _old_plain_baseline(e) + [
            "Every drafter drafts the whole batch at once (one draft forward per depth for all rows) and verification is "
            "one batched forward; on this 2-core CPU a forward's cost still grows with the rows it computes, so the "
            "crossover is what this machine measured, and `make gpu-check` runs the same sweep briefly on a GPU.", ""]


def _old_plain_baseline(e: dict) -> list[str]:
    from draftsmith.runtime.sweep import PLAIN_BASELINE
    if e.get("plain_baseline") == PLAIN_BASELINE:
        return []
    return ["Measured before plain batched decoding lost its per-row host steps (2026-12-06; a third of a plain run at "
            "B = 512): the speedups at large batch sizes and the crossovers above are overstated.", ""]


def _batched_against_row_by_row(r: dict) -> list[str]:
    """The crossover and vLLM schedule of the batched sweep next to the row-by-row one it replaced (#22)."""
    old, new = r.get("economics_row_by_row"), r["economics"]
    if not old:
        return []
    lines = [f"Batched drafting against the row-by-row drafting of the sweep of {old['date']} (same head, prompts and "
             "settings; each row of that sweep had a batch-1 drafter of its own):", "",
             "| drafter | crossover batched / row by row | vLLM schedule batched | vLLM schedule row by row |", "|---|---|---|---|"]
    for name, d in new["drafters"].items():
        was = old["drafters"].get(name)
        if was:
            lines.append(f"| {name} | {d['crossover_batch_size'] or 'none'} / {was['crossover_batch_size'] or 'none'} | "
                         f"`{json.dumps(d['schedule'])}` | `{json.dumps(was['schedule'])}` |")
    return lines + [""]

