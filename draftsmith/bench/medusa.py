"""`make bench` section `medusa`: the Medusa-1 and Medusa-2 demos run as `make demo RECIPE=...` runs them,
next to the EAGLE-3 demo's validation on the same prompts."""
from __future__ import annotations

import json

from draftsmith import recipe as recipe_mod
from draftsmith.bench.common import fmt_values
from draftsmith.heads.hf_layout import drift_summary


MEDUSA_RUNS = {"medusa1": "recipes/demo/stdlib-code-medusa1.yaml", "medusa2": "recipes/demo/stdlib-code-medusa2.yaml"}
# EAGLE-3's row comes from the runtime section: the EAGLE-3 demo's validation on the same prompts


def bench_medusa(overrides: list[str]) -> dict:
    """Each demo recipe through `draftsmith run` (current stages kept), then its validation read back."""
    from draftsmith import artifacts, stages
    out = {}
    for name, path in MEDUSA_RUNS.items():
        recipe = recipe_mod.load(path, overrides)
        print(stages.run_all(recipe), flush=True)
        v = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())
        meta = artifacts.read_json(recipe.run_dir / "head" / "head.json")
        final = meta.get("final_metrics") or {}
        num_heads = recipe.head.num_heads if recipe.head.kind == "medusa" else 0
        out[name] = {"kind": recipe.head.kind, "variant": meta["draft_config"].get("draftsmith", {}).get("variant", recipe.head.kind),
                     "train_steps": meta.get("step"), "train_seconds": (final.get("tokens") or 0) / max(final.get("tokens_per_s") or 1, 1e-9),
                     "tau": v["tau"], "speedup_vs_plain": v["speedup_vs_plain"], "exact": f"{v['num_exact']}/{v['num_prompts']}",
                     "acceptance_per_depth": v["acceptance_per_depth"], "draft_to_target_cost_c": v["draft_to_target_cost_c"],
                     "tree_nodes": v["tree"]["num_nodes"], "sampled": v.get("sampled"), "typical": v.get("typical_acceptance"),
                     "eval_top1": [final.get(f"eval_top1_{k}") for k in range(num_heads)],
                     "eval_top5": [final.get(f"eval_top5_{k}") for k in range(num_heads)],
                     "calibration_top1": (v.get("calibration") or {}).get("per_head_top1"),
                     "tree_choices": v["tree"].get("choices"), "drift": v.get("drift")}
        print(f"[bench] {name}: tau {v['tau']:.2f}, {v['speedup_vs_plain']:.2f}x", flush=True)
    return out


def render_medusa(r: dict) -> list[str]:
    if "medusa" not in r:
        return []
    m = r["medusa"]
    lines = ["## Medusa-1, Medusa-2 and EAGLE-3 on the demo (issue #12)", "",
             f"Each demo recipe run as `make demo RECIPE=...` runs it ({r.get('measured', {}).get('medusa', r['date'])}); "
             "greedy decoding on the same 16 held-out prompts, tree settings from each recipe (Medusa: a tree built from "
             "the heads' measured per-rank accuracies on 8 other held-out prompts). Sampled rows: temperature 0.8, "
             "lossless verification (Medusa: the heads' distributions as proposals); typical acceptance is Medusa's "
             "lossy rule, shown for comparison only.", "",
             "| head | train steps (s) | tree nodes | tau | speedup vs plain | greedy exact | sampled tau | typical tau (lossy) | c |",
             "|---|---|---|---|---|---|---|---|---|"]
    rt = r["runtime"]
    rows = dict(m)
    rows["eagle3 (runtime section)"] = {"train_steps": (rt.get("training") or {}).get("step", "-"), "train_seconds": 0.0,
                                        "tree_nodes": rt["tree"]["num_nodes"], "tau": rt["tau"], "speedup_vs_plain": rt["speedup_vs_plain"],
                                        "exact": f"{rt['num_exact']}/{rt['num_prompts']}", "sampled": rt.get("sampled"),
                                        "draft_to_target_cost_c": rt["draft_to_target_cost_c"]}
    for name, h in rows.items():
        sampled = f"{h['sampled']['tau']:.2f}" if h.get("sampled") else "-"
        typical = f"{h['typical']['tau']:.2f}" if h.get("typical") else "-"
        seconds = f" ({h['train_seconds']:.0f})" if h["train_seconds"] else ""
        lines.append(f"| {name} | {h['train_steps']}{seconds} | {h['tree_nodes']} | {h['tau']:.2f} | "
                     f"{h['speedup_vs_plain']:.2f}x | {h['exact']} | {sampled} | {typical} | {h['draft_to_target_cost_c']:.3f} |")
    lines += ["", "Per-head accuracy (head k predicts token t+2+k) against the target's argmax:", "",
              "| head | held-out top-1 per head (training eval) | top-5 per head | top-1 on validation continuations |",
              "|---|---|---|---|"]
    for name, h in m.items():
        if h["kind"] == "medusa":
            lines.append(f"| {name} | {fmt_values(h['eval_top1'])} | {fmt_values(h['eval_top5'])} | {fmt_values(h['calibration_top1'])} |")
    drift = (m.get("medusa2") or {}).get("drift")
    if drift:
        lines += ["", "Medusa-2 changes the served model. Drift of its fine-tuned target from the original on the same "
                  f"{drift['num_prompts']} held-out prompts: {drift_summary(drift)}."]
    return lines + [""]
