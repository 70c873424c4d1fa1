"""The economics stage's report: economics.md (drafter table, throughput and cost at the best K per batch
size, the schedule and engine settings) and its plots, from economics.json's result."""
from __future__ import annotations

import json
from pathlib import Path

from draftsmith import artifacts


def _plots(out_dir: Path, result: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = result["batch_sizes"]
    kind = result["kind"]
    head = result["drafters"][kind]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [result["plain"][str(b)]["tokens_per_s"] for b in sizes], "k-o", label="plain (K=0)")
    for k in result["num_speculative_tokens"]:
        if str(k) in head["cells"][str(sizes[0])]:
            ax.plot(sizes, [head["cells"][str(b)][str(k)]["tokens_per_s"] for b in sizes], marker=".", label=f"{kind} K={k}")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="output tokens/s", title=f"{kind}: throughput against load")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=100)
    plt.close(fig)
    fig, (ax1, ax2, ax3, ax4) = plt.subplots(1, 4, figsize=(20, 4))
    top = 1.0
    for name, d in result["drafters"].items():
        points = d["predicted_vs_measured"]
        ax1.scatter([p["predicted"] for p in points], [p["measured"] for p in points], label=name)
        top = max([top] + [p["predicted"] for p in points] + [p["measured"] for p in points])
        best = [d["cells"][str(b)][str(d["best_k"][str(b)])]["tokens_per_s"] if d["best_k"][str(b)] else result["plain"][str(b)]["tokens_per_s"]
                for b in sizes]
        ax2.plot(sizes, [s / result["plain"][str(b)]["tokens_per_s"] for s, b in zip(best, sizes)], marker="o", label=name)
        ax4.plot(sizes, [d["by_batch_size"][str(b)]["c"] for b in sizes], marker="o", label=name)
    ax1.plot([0, top], [0, top], "k:", label="predicted = measured")
    ax1.set(xlabel="Theorem 3.8 prediction tau/(K c + 1)", ylabel="measured speedup", title=f"batch size {sizes[0]}, every K")
    ax1.legend(fontsize=7)
    ax2.axhline(1.0, color="k", linestyle=":")
    ax2.set(xscale="log", xlabel="batch size", ylabel="speedup at the best K", title="drafters side by side")
    ax2.legend(fontsize=7)
    names = list(result["drafters"])
    domains = sorted({dom for d in result["drafters"].values() for dom in d["per_domain"]})
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        per = result["drafters"][name]["per_domain"]
        ax3.bar([j + i * width for j in range(len(domains))], [per.get(dom, {}).get("alpha_iid", 0) for dom in domains], width, label=name)
    ax3.set_xticks([j + 0.4 - width / 2 for j in range(len(domains))], domains, fontsize=7)
    ax3.set(ylabel="i.i.d. alpha", ylim=(0, 1), title="acceptance per domain (largest K)")
    ax3.legend(fontsize=7)
    positive = all(d["by_batch_size"][str(b)]["c"] > 0 for d in result["drafters"].values() for b in sizes)
    ax4.set(xscale="log", yscale="log" if positive else "linear", xlabel="batch size", ylabel="c(B) = draft step / plain decode step",
            title="draft cost against load (batched drafting)")
    ax4.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "drafters.png", dpi=100)
    plt.close(fig)


def drafters_table(result: dict) -> list[str]:
    """One row per drafter: c, the low-batch figures, crossover, the vLLM schedule, exactness."""
    lines = ["| drafter | c | best K at B=1 | tau | speedup B=1 predicted / measured | c* | crossover batch size | vLLM schedule | exact rows |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, d in result["drafters"].items():
        low = d["low_batch"]
        lines.append(f"| {name} | {d['c']:.3f} | {low['k']} | {low['tau']:.2f} | {low['predicted_walltime_factor']:.2f}x / "
                     f"{low['measured_walltime_factor']:.2f}x | {low['break_even_c']:.3f} | {d['crossover_batch_size'] or 'none'} | "
                     f"`{json.dumps(d['schedule'])}` | {d['exact_rows']}/{d['rows']} |")
    return lines


def throughput_table(result: dict) -> list[str]:
    """Per batch size: tokens/s (TPOT / TTFT) of plain decoding and of each drafter at its best K; $/Mtok when priced."""
    names = list(result["drafters"])
    priced = result.get("gpu_hour_usd") is not None
    header = ["batch", "plain"] + names + (["$/Mtok plain"] + [f"$/Mtok {n}" for n in names] if priced else [])
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for b in result["batch_sizes"]:
        p = result["plain"][str(b)]
        row = [str(b), f"{p['tokens_per_s']:.0f} ({p['tpot_ms']:.1f} / {p['ttft_ms']:.0f})"]
        for d in result["drafters"].values():
            k = d["best_k"][str(b)]
            c = d["cells"][str(b)].get(str(k)) if k else None
            row.append(f"{c['tokens_per_s']:.0f} (K={k}; {c['tpot_ms']:.1f} / {c['ttft_ms']:.0f})" if c else "K=0: plain")
        if priced:
            costs = [d["cost"][str(b)] for d in result["drafters"].values()]
            row += [f"{costs[0]['plain_usd_per_mtok']:.2f}"] + [f"{c['spec_usd_per_mtok']:.2f} (M {c['multiplier']:.2f})" for c in costs]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def report_lines(result: dict) -> list[str]:
    lines = ["# Economics report", "",
             f"- target `{result['target']}`, head `{result['head']}` ({result['kind']}) on {result['machine']} "
             f"({result['device']}, {result['dtype']}), {result['date']}",
             f"- {result['num_prompts']} prompts repeated to fill each batch, {result['max_new_tokens']} new tokens per row, greedy; "
             f"K = speculative tokens per row (one chain); batch sizes {result['batch_sizes']}"
             + (f"; skipped: {result['skipped_batch_sizes']}" if result["skipped_batch_sizes"] else ""), "",
             "## Drafters side by side", ""] + drafters_table(result)
    lines += ["", "## Output tokens/s at the best K (TPOT / TTFT in ms)" + (f", $/1M output tokens at ${result['gpu_hour_usd']}/h"
              if result.get("gpu_hour_usd") is not None else ""), ""] + throughput_table(result)
    for name, d in result["drafters"].items():
        lines += ["", f"### {name}", "", f"- vLLM: `--speculative-config '{json.dumps(d['vllm_speculative_config'])}'`"]
        if "sglang" in d:
            s = d["sglang"]
            lines.append(f"- SGLang: `--speculative-num-steps {s['speculative_num_steps']} --speculative-eagle-topk 1 "
                         f"--speculative-num-draft-tokens {s['speculative_num_draft_tokens']}` ({s['note']})")
        if d["per_domain"]:
            lines.append("- per domain (largest K): " + ", ".join(f"{dom} tau {v['tau']:.2f} alpha {v['alpha_iid']:.3f}"
                                                                    for dom, v in d["per_domain"].items()))
        if "cost" in d:
            lines += ["", f"| batch | K | plain $/Mtok | speculative $/Mtok | M | break-even extra $/h | pays at +${result['extra_usd_per_hour']}/h |",
                      "|---|---|---|---|---|---|---|"]
            for b, c in d["cost"].items():
                lines.append(f"| {b} | {c['k']} | {c['plain_usd_per_mtok']:.2f} | {c['spec_usd_per_mtok']:.2f} | {c['multiplier']:.2f} "
                             f"| {c['break_even_extra_usd_per_hour']:.2f} | {c['pays']} |")
    lines += ["", "## Draft cost against load", "", "One batched drafter drafts every row (one draft forward per depth for "
              "the batch); c(B) = draft seconds per round / K over plain seconds per round at that batch size, and "
              "Theorem 3.8 refit with it.", ""] + cost_table(result)
    lines += ["", "![throughput](throughput.png)", "", "![drafters](drafters.png)", ""]
    return lines


def cost_table(result: dict) -> list[str]:
    """Per batch size and drafter: draft ms per round, c(B), K, predicted / measured walltime factor."""
    names = list(result["drafters"])
    lines = ["| batch | " + " | ".join(f"{n}: draft ms/round, c(B), K, predicted / measured" for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for b in result["batch_sizes"]:
        row = [str(b)]
        for d in result["drafters"].values():
            x = d["by_batch_size"][str(b)]
            row.append(f"{x['draft_ms_per_round']:.1f}, {x['c']:.3f}, {x['k']}, "
                       f"{x['predicted_walltime_factor']:.2f}x / {x['measured_walltime_factor']:.2f}x")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def write_economics_report(out_dir: Path, result: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    _plots(out_dir, result)
    with artifacts.atomic_path(out_dir / "economics.md") as tmp:
        tmp.write_text("\n".join(report_lines(result)))
    artifacts.write_json(out_dir / "economics.json", result)
