"""`make bench` sections `heads`, `mtp` and `drafters*`: head kinds trained for the same wall-clock on the
demo's data and validated (EAGLE-2 k = 1 / 3, EAGLE-3, MTP k = 1 / 3, the parallel drafters); the Medusa
section is bench/medusa.py."""
from __future__ import annotations

import json
import time

from draftsmith import recipe as recipe_mod
from draftsmith.bench.common import cpu_of, fmt_values, in_fresh_process, link_data
from draftsmith.bench.medusa import render_medusa
from draftsmith.runtime.sweep import PLAIN_BASELINE


HEAD_RUNS = {  # name -> (recipe, overrides); compared at the same training wall-clock
    "eagle2-k1": ("recipes/demo/stdlib-code-eagle2.yaml", ["head.ttt_steps=1"]),
    "eagle2-k3": ("recipes/demo/stdlib-code-eagle2.yaml", ["head.ttt_steps=3"]),
    "eagle3-k7": ("recipes/demo/stdlib-code-eagle3.yaml", []),
}


def _steps_for(recipe, seconds: float, probe_steps: int = 12) -> tuple[int, float]:
    """(optimizer steps that fit `seconds` of training, measured tokens/s) for this recipe's head."""
    from draftsmith.train.run import build_trainer
    trainer = build_trainer(recipe)
    batches = trainer.micro_batches()
    trainer.train_step(next(batches))  # warm-up
    start, tokens = time.perf_counter(), trainer.tokens
    for _ in range(probe_steps):
        trainer.train_step(next(batches))
    per_step = (time.perf_counter() - start) / probe_steps
    return max(1, int(seconds / per_step / recipe.train.grad_accum)), (trainer.tokens - tokens) / (per_step * probe_steps)


DRAFTER_RUNS = {  # issue #31: block drafting and EAGLE 3.1 / LK next to EAGLE-3, same budget as `heads`
    "eagle3-k7": ("recipes/demo/stdlib-code-eagle3.yaml", []),
    "eagle3.1+lk": ("recipes/demo/stdlib-code-eagle3.yaml", ["head.fc_norm=true", "head.norm_output=true",
                                                              "head.objective=lk_lambda"]),
    "dflash-b16": ("recipes/demo/stdlib-code-dflash.yaml", []),
    "dflash-b16+lk": ("recipes/demo/stdlib-code-dflash.yaml", ["head.objective=lk_lambda"]),
    # blocks of 8 (7 draft tokens): at large batch sizes the sweep's best K is 3 or 7, slots a shorter block trains more
    "dflash-b8": ("recipes/demo/stdlib-code-dflash.yaml", ["head.block_size=8", "head.num_anchors=16", "head.loss_gamma=3",
                                                           "validate.depth=7", "validate.num_nodes=8"]),
    # and with the 1024-token draft vocabulary EAGLE-3's demo head drafts over (speculators' DFlash option)
    "dflash-b8+dv": ("recipes/demo/stdlib-code-dflash.yaml", ["head.block_size=8", "head.num_anchors=16", "head.loss_gamma=3",
                                                              "validate.depth=7", "validate.num_nodes=8",
                                                              "head.draft_vocab_size=1024"]),
    "peagle": ("recipes/demo/stdlib-code-peagle.yaml", []),
}


SECOND_TARGET = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)  # Qwen3 layers (q/k norms), the demo's sizes


def bench_drafters_qwen3(recipe_path: str, overrides: list[str], seconds: float, target_steps: int = 600) -> dict:
    """The drafters of `DRAFTER_RUNS` on a second target: a tiny Qwen3 trained on the demo's corpus, its own
    regenerated answers as data, the same training wall-clock each."""
    from pathlib import Path
    from draftsmith.bench.common import corpus_target
    from draftsmith.stages import stage_data
    demo = recipe_mod.load(recipe_path, overrides)
    scratch = Path(demo.out_dir) / "bench-qwen3"
    target = scratch / "target"
    if not (target / "config.json").exists():
        corpus_target("qwen3", Path(demo.target.model), target, demo.target.embedded, target_steps, **SECOND_TARGET)
    common = [f"out_dir={scratch}", f"target.model={target}", "target.embedded=null", "economics.draft_model_embedded=null",
              "data.max_conversations=800", "data.regen.max_new_tokens=160"]
    data_recipe = recipe_mod.load(recipe_path, overrides + common + ["name=bench-qwen3-data"])
    stage_data(data_recipe)
    out = bench_heads(data_recipe, overrides + common, seconds, DRAFTER_RUNS)
    return {name: {**row, "target": f"qwen3 (hidden 128, 8 layers) trained {target_steps} steps"} for name, row in out.items()}


DFLASH_RUNS = ("dflash-b16", "dflash-b16+lk", "dflash-b8", "dflash-b8+dv")  # the DFlash rows the goals (1.3x EAGLE-3's speedup, a higher crossover) read
BUDGET_RUNS = {name: DRAFTER_RUNS[name] for name in ("eagle3-k7", "dflash-b16", "dflash-b16+lk", "dflash-b8")}


def bench_drafters_budget(data_recipe, overrides: list[str], seconds: float) -> dict:
    """EAGLE-3 and DFlash (with and without LK) at a larger equal training wall-clock than the `drafters` section's: whether DFlash's
    speedup over EAGLE-3's grows with training (the published drafts train for epochs on ~800K samples)."""
    return bench_heads(data_recipe, overrides, seconds, BUDGET_RUNS, prefix="bench-budget")


ECONOMICS = ["economics.batch_sizes=[1,4,16,32,64,128,256]", "economics.num_speculative_tokens=[3,7,15]",
             "economics.baselines=[]", "economics.max_new_tokens=48", "economics.draft_model_embedded=null",
             "economics.repeats=2"]


def _sweep(path: str, overrides: list[str], out: str) -> None:
    from draftsmith.runtime.sweep import run_economics
    run_economics(recipe_mod.load(path, overrides), out=out)


def bench_drafters_economics(overrides: list[str], drafters: dict, heads: dict = DRAFTER_RUNS,
                             prefix: str = "bench-heads") -> dict:
    """One batched sweep (`draftsmith economics`, greedy, K 3, 7 and 15: DFlash drafts 15 in one forward) of every
    head a section trained (`drafters`: `DRAFTER_RUNS` in run dirs bench-heads-*; `drafters_budget`: `BUDGET_RUNS` in
    bench-budget-*): EAGLE-3's recipe with the others under `economics.compare`, so that at each
    batch size every head runs twice in turn with plain decoding between the heads (a cell's speedup is over the plain runs
    beside it). Per head: the best speedup over plain batched decoding per batch size, the crossover, c at B = 1, and
    per batch size and K the speedup, tau and a round's draft and verify milliseconds (`by_k`). The sweep runs in a
    process of its own (`in_fresh_process`)."""
    runs = {name: recipe_mod.load(path, overrides + extra + [f"name={prefix}-{name}"])
            for name, (path, extra) in heads.items()}
    base, *others = heads
    compare = "economics.compare=[" + ",".join(str(runs[name].run_dir / "head") for name in others) + "]"
    path, extra = heads[base]
    sweep = overrides + extra + [f"name={prefix}-{base}", "train.save_every=100000", "train.eval_every=100000",
                                 f"train.max_steps={drafters[base]['train_steps']}", *ECONOMICS, compare]
    report = recipe_mod.load(path, sweep).run_dir / "economics-bench"
    in_fresh_process(_sweep, path, sweep, str(report))
    e = json.loads((report / "economics.json").read_text())
    names = {e["kind"]: base} | {runs[name].run_dir.name: name for name in others}
    out = {}
    for key, head in e["drafters"].items():
        best = {str(b): max(cell["speedup"] for cell in head["cells"][str(b)].values()) for b in e["batch_sizes"]}
        out[names[key]] = {"plain_baseline": PLAIN_BASELINE,
                           "speedup_by_batch_size": best, "crossover_batch_size": head["crossover_batch_size"], "c": head["c"],
                           "best_k": head["best_k"], "tau_by_batch_size": {str(b): head["cells"][str(b)][str(head["best_k"][str(b)] or 7)]["tau"]
                                                                           for b in e["batch_sizes"]},
                           "by_k": {str(b): {k: {"speedup": c["speedup"], "tau": c["tau"],
                                                 "draft_ms": c["draft_ms_per_round"], "verify_ms": 1e3 * c["verify_seconds"] / c["num_rounds"]}
                                             for k, c in head["cells"][str(b)].items()} for b in e["batch_sizes"]}}
        print(f"[bench] {names[key]} economics: {out[names[key]]}", flush=True)
    return out


MTP_RUNS = {  # MTP post hoc: DeepSeek's one-step objective and the recursive default, same budget as `heads`
    "mtp-k1": ("recipes/demo/stdlib-code-mtp.yaml", ["head.ttt_steps=1"]),
    "mtp-k3": ("recipes/demo/stdlib-code-mtp.yaml", ["head.ttt_steps=3"]),
}


def bench_heads(data_recipe, overrides: list[str], seconds: float, runs: dict = HEAD_RUNS, prefix: str = "bench-heads",
                side_by_side_repeats: int = 5) -> dict:
    """Each head kind trained for the same wall-clock on the demo's data, then validated (run dirs `{prefix}-{name}`);
    then, with `side_by_side_repeats`, their speedups measured side by side."""
    import shutil
    from draftsmith import artifacts
    from draftsmith.data.capture import run_capture
    from draftsmith.heads.registry import capture_needs, head_spec
    from draftsmith.runtime.validate import run_validate
    from draftsmith.train.run import run_train
    out, trained = {}, {}
    for name, (path, extra) in runs.items():
        base = overrides + extra + [f"name={prefix}-{name}", "train.save_every=100000", "train.eval_every=100000"]
        recipe = recipe_mod.load(path, base)
        link_data(recipe, data_recipe)
        manifest = run_capture(recipe, capture_needs(recipe.head.kind))
        steps, tokens_per_s = _steps_for(recipe, seconds)
        shutil.rmtree(recipe.run_dir / "train", ignore_errors=True)
        recipe = recipe_mod.load(path, base + [f"train.max_steps={steps}"])
        start = time.perf_counter()
        run_train(recipe)
        train_seconds = time.perf_counter() - start
        tensors, _ = artifacts.load_checkpoint(recipe.run_dir / "head")
        frozen = head_spec(recipe.head.kind).model.FROZEN  # saved yet frozen: a DFlash draft vocabulary's lm_head rows
        trainable = sum(t.numel() for k, t in tensors.items() if t.is_floating_point() and not k.startswith(frozen))
        val = run_validate(recipe)
        report = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())
        out[name] = {"kind": recipe.head.kind, "train_steps": steps, "train_seconds": train_seconds,
                     "train_tokens_per_s": tokens_per_s, "trainable_parameters": trainable,
                     "bytes_per_token": manifest["bytes_per_token"], "tau": val["tau"], "speedup_vs_plain": val["speedup_vs_plain"],
                     "exact": f"{report['num_exact']}/{report['num_prompts']}",
                     "acceptance_per_depth": report["acceptance_per_depth"], "draft_to_target_cost_c": report["draft_to_target_cost_c"],
                     "budget_seconds": seconds}
        trained[name] = recipe
        print(f"[bench] {name}: {out[name]}", flush=True)
    if len(trained) > 1 and side_by_side_repeats:
        for name, row in side_by_side(trained, side_by_side_repeats).items():
            out[name].update(speedup_side_by_side=row["speedup"], side_by_side_passes=row["passes"])
            print(f"[bench] {name} side by side: {row}", flush=True)
    return out


def side_by_side(recipes: dict, repeats: int = 5) -> dict:
    """Speedup over plain decoding of several trained heads measured together, so that the machine's drift (this
    shared host's speed moves by up to 1.5x within a session) falls on all of them alike: each head on its own copy
    of the target, then `repeats` passes over the held-out prompts where every prompt runs plain and speculative
    decoding for each head in turn (the order rotated per prompt). Per head: each pass's total plain over total
    speculative time (greedy: the same tokens, checked) and their median."""
    from draftsmith.runtime.generate import plain_generate, speculative_generate
    from draftsmith.runtime.loading import (eos_ids, load_target_and_head, validation_drafter, validation_max_len,
                                            validation_prompts)
    from draftsmith.runtime.target import TargetRunner
    from draftsmith.runtime.verify import SamplingConfig
    setups, greedy = {}, SamplingConfig()
    for name, recipe in recipes.items():
        cfg = recipe.validate
        model, tokenizer, head, _, _ = load_target_and_head(recipe, None)
        prompts = [p.to(model.device) for p, _, _ in validation_prompts(recipe, tokenizer, cfg.num_prompts)]
        max_len = validation_max_len(recipe, prompts)
        runner = TargetRunner(model, max_len, head.config.get("draftsmith", {}).get("layer_ids", []))
        drafter = validation_drafter(recipe, head, max_len, model.device)
        eos = eos_ids(model, tokenizer)
        plain_generate(runner, prompts[0], 8, greedy, eos)  # warm-up
        speculative_generate(runner, drafter, prompts[0], 8, greedy, eos)
        setups[name] = (runner, drafter, prompts, eos, cfg.max_new_tokens)
    names = list(setups)
    passes = {name: [] for name in names}
    for _ in range(repeats):
        plain, spec = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
        for i in range(len(setups[names[0]][2])):
            for name in names[i % len(names):] + names[:i % len(names)]:
                runner, drafter, prompts, eos, new = setups[name]
                base = plain_generate(runner, prompts[i], new, greedy, eos)
                fast = speculative_generate(runner, drafter, prompts[i], new, greedy, eos)
                if base.tokens != fast.tokens:
                    raise RuntimeError(f"{name}: speculative output differs from plain decoding on prompt {i}")
                plain[name], spec[name] = plain[name] + base.seconds, spec[name] + fast.seconds
        for name in names:
            passes[name].append(plain[name] / spec[name])
    out = {}
    for name in names:
        runs = sorted(passes[name])
        out[name] = {"speedup": runs[len(runs) // 2], "passes": passes[name]}
    return out


def render_heads(r: dict) -> list[str]:
    return _render_heads(r) + render_medusa(r) + _render_mtp(r)


def _render_heads(r: dict) -> list[str]:
    if "heads" not in r:
        return []
    lines = ["## Head kinds at equal training wall-clock (issue #11)", "",
             f"Each head trained for the same wall-clock on the demo's data ({r.get('measured', {}).get('heads', r['date'])}), "
             "then validated like the runtime section (same prompts, chain depth and tree settings from its recipe). "
             "EAGLE-2 drafts over the full vocabulary through the target's lm_head; EAGLE-3 over its 1024-token draft "
             "vocabulary.", "",
             "| head | TTT k | train steps (s) | training tokens/s | trainable params | store bytes/token | tau | speedup vs plain | greedy exact |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, h in r["heads"].items():
        lines.append(f"| {name} | {name.rsplit('-k', 1)[-1]} | {h['train_steps']} ({h['train_seconds']:.0f}) | {h['train_tokens_per_s']:.0f} | "
                     f"{h['trainable_parameters'] / 1e6:.2f}M | {h['bytes_per_token']:.0f} | {h['tau']:.2f} | "
                     f"{h['speedup_vs_plain']:.2f}x | {h['exact']} |")
    best = max(r["heads"], key=lambda name: r["heads"][name]["tau"])
    return lines + ["", f"Highest tau at this budget: {best}. Store bytes/token: EAGLE-2 stores the final hidden state once "
                    "(feature and teacher, 1·H bf16, compressed); EAGLE-3 its mid and high features (compact store). "
                    "Trainable parameters exclude the frozen embedding (and, for EAGLE-2, the target's lm_head). "
                    "Caveats: the demo target is tiny (H = 128, 8 layers) and its data are its own regenerated "
                    "answers, so the final hidden state nearly determines the next token and EAGLE-2's single feature "
                    "is very informative; EAGLE-3's extra features and TTT pay off on large targets and diverse data. "
                    "At equal wall-clock, TTT k = 3 runs 2.5x fewer EAGLE-2 steps and ends below k = 1, so EAGLE-2 "
                    "keeps the published one-step objective as its default.", ""]


def _render_mtp(r: dict) -> list[str]:
    if "mtp" not in r:
        return []
    rows = dict(r["mtp"])
    if "eagle3-k7" in r.get("heads", {}):
        rows["eagle3-k7 (heads section)"] = r["heads"]["eagle3-k7"]
    lines = ["## MTP against EAGLE-3 at equal training wall-clock (issue #13)", "",
             f"MTP trained post hoc on the frozen demo target (one Llama layer: the target's own; enorm, hnorm, eh_proj; "
             f"the target's lm_head), {r.get('measured', {}).get('mtp', r['date'])}; each run gets the same training "
             "wall-clock as the heads section's EAGLE-3 run, then is validated on the same 16 prompts with a chain of 8.", "",
             "| head | training budget (s) | train steps | training tokens/s | trainable params | tau | speedup vs plain | greedy exact | acceptance per depth |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, h in rows.items():
        lines.append(f"| {name} | {h.get('budget_seconds', 180):.0f} | {h['train_steps']} | {h['train_tokens_per_s']:.0f} | "
                     f"{h['trainable_parameters'] / 1e6:.2f}M | {h['tau']:.2f} | {h['speedup_vs_plain']:.2f}x | {h['exact']} | "
                     f"{fmt_values(h['acceptance_per_depth'][:4])} |")
    return lines + [""]


def speed(row: dict) -> float:
    """A trained head's speedup over plain decoding: measured side by side with the others (`side_by_side`) where
    it was, else its own validation's."""
    return row.get("speedup_side_by_side") or row["speedup_vs_plain"]


def dflash_ratios(rows: dict) -> dict[str, float]:
    """Each DFlash row's speedup over EAGLE-3's (`speed`), for the rows present."""
    return {name: speed(rows[name]) / speed(rows["eagle3-k7"]) for name in DFLASH_RUNS if name in rows and "eagle3-k7" in rows}


def _side(row: dict) -> str:
    return f"{row['speedup_side_by_side']:.2f}x" if row.get("speedup_side_by_side") else "-"


def render_drafters(r: dict) -> list[str]:
    rows = r.get("drafters")
    if not rows:
        return []
    return _render_drafters(r, rows) + _render_budget(r) + _render_second_target(r)


def _render_budget(r: dict) -> list[str]:
    rows = r.get("drafters_budget")
    if not rows or "eagle3-k7" not in rows:
        return []
    base, short = rows["eagle3-k7"], r.get("drafters") or {}
    lines = ["### EAGLE-3 and DFlash at a larger budget", "",
             f"The same recipes, each trained {base['budget_seconds']:.0f} s instead of "
             f"{short.get('eagle3-k7', {}).get('budget_seconds', 0):.0f} s, validated as above "
             f"({r.get('measured', {}).get('drafters_budget', r['date'])}); the ratio to EAGLE-3 at the short budget "
             "is from the table above" + ("" if _machine(r, "drafters_budget") == _machine(r, "drafters") else
                                          f" (measured on {_machine(r, 'drafters')}, where the same wall-clock "
                                          "buys other training steps)") + ".", "",
             "| drafter | train steps (s) | tau | draft cost c | speedup vs plain (validation) | side by side | vs EAGLE-3 "
             "| vs EAGLE-3 at the short budget | greedy exact |", "|---|---|---|---|---|---|---|---|---|"]
    for name, h in rows.items():
        was = (speed(short[name]) / speed(short["eagle3-k7"])) if name in short else None
        lines.append(f"| {name} | {h['train_steps']} ({h['train_seconds']:.0f}) | {h['tau']:.2f} | "
                     f"{h['draft_to_target_cost_c']:.2f} | {h['speedup_vs_plain']:.2f}x | {_side(h)} | "
                     f"{speed(h) / speed(base):.2f}x | "
                     f"{f'{was:.2f}x' if was is not None else '-'} | {h['exact']} |")
    econ = r.get("drafters_budget_economics")
    if econ and "eagle3-k7" in econ:
        shortfall = crossover_shortfall(econ)
        lines += _render_sweep(r, econ, "drafters_budget_economics") + ["", "- At this budget " + ", ".join(
            f"{name} crosses over at {econ[name]['crossover_batch_size'] or 'none within the sweep'}" for name in DFLASH_RUNS
            if name in econ) + f" against EAGLE-3's {econ['eagle3-k7']['crossover_batch_size'] or 'none within the sweep'} "
            f"(goal: a higher crossover: {'met' if shortfall == '' else 'not met'})."]
    return lines + [""]


def _machine(r: dict, section: str) -> str:
    """The CPU a section was measured on (its `measured` line, else the bench's date line)."""
    return cpu_of(r.get("measured", {}).get(section, r["date"]))


def _render_second_target(r: dict) -> list[str]:
    rows = r.get("drafters_qwen3")
    if not rows:
        return []
    base = rows["eagle3-k7"]
    lines = ["### The same drafters on a second target", "",
             f"A tiny Qwen3 (q/k norms, the demo's sizes; {base.get('target', '')}) on the demo's corpus, its own regenerated "
             f"answers as data, each drafter trained {base['budget_seconds']:.0f} s and validated as above "
             f"({r.get('measured', {}).get('drafters_qwen3', r['date'])}).", "",
             "| drafter | train steps (s) | tau | draft cost c | speedup vs plain (validation) | side by side | vs EAGLE-3 "
             "| greedy exact |", "|---|---|---|---|---|---|---|---|"]
    for name, h in rows.items():
        lines.append(f"| {name} | {h['train_steps']} ({h['train_seconds']:.0f}) | {h['tau']:.2f} | "
                     f"{h['draft_to_target_cost_c']:.2f} | {h['speedup_vs_plain']:.2f}x | {_side(h)} | "
                     f"{speed(h) / speed(base):.2f}x | {h['exact']} |")
    return lines + [""]


def _render_sweep(r: dict, econ: dict, section: str = "drafters_economics") -> list[str]:
    """The batched sweep of one section's heads (`drafters_economics`, `drafters_budget_economics`): best speedup per
    batch size, crossover, and per K at B = 128."""
    sizes = list(next(iter(econ.values()))["speedup_by_batch_size"])
    lines = ["", "In the batched sweep (`draftsmith economics` on the same heads, all of them in one sweep "
              "(`economics.compare`): at each B plain decoding and every head at K 3, 7 and 15 (each as many as it drafts) run in turn, twice "
              "(`economics.repeats: 2`), plain decoding between the heads; greedy, 16 prompts repeated to fill B rows, "
              "48 new tokens, the better K per B; speedup over the plain batched runs beside each run at the same B (the "
              "median of the two); "
              f"{r.get('measured', {}).get(section, r['date'])}. On this shared machine, whose speed "
              "varied by up to 1.5x within a session, a cell still moves between sweeps, and the non-monotone "
              "rows show it; the heads' ratios at one B, measured minutes apart, move less):", "",
              "| drafter | " + " | ".join(f"B = {b}" for b in sizes) + " | crossover (plain faster from) |",
              "|---|" + "---|" * len(sizes) + "---|"]
    for name, h in econ.items():
        lines.append(f"| {name} | " + " | ".join(f"{h['speedup_by_batch_size'][b]:.2f}x" for b in sizes) +
                     f" | {h['crossover_batch_size'] or 'none up to ' + sizes[-1]} |")
    if any(h.get("plain_baseline") != PLAIN_BASELINE for h in econ.values()):
        lines += ["", "Measured before plain batched decoding lost its per-row host steps (a tree, a verification and a path "
                  "per row, every step: a third of a plain run at B = 512): every speedup from B = 64 on is overstated, and so "
                  "are the crossovers. README (\"Plain batched decoding without per-row host steps\") has the sweep since: "
                  "EAGLE-3 and DFlash both cross over at 32 on a 2-core CPU."]
    at = "128" if "128" in sizes else sizes[-1]
    if all("by_k" in h for h in econ.values()):
        ks = sorted({int(k) for h in econ.values() for k in h["by_k"][at]})
        lines += ["", f"Per K at B = {at}: speedup, tau, and a round's draft / "
                  "verify milliseconds. On a 2-core CPU a forward's cost grows with the tokens it computes from B = 32 on, so "
                  "DFlash's one block forward costs about what EAGLE-3's K steps do, and tau at the same K decides:", "",
                  "| drafter | " + " | ".join(f"K = {k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
        for name, h in econ.items():
            cells = h["by_k"][at]
            lines.append(f"| {name} | " + " | ".join(
                f"{c['speedup']:.2f}x, tau {c['tau']:.2f}, {c['draft_ms']:.1f} / {c['verify_ms']:.1f} ms" if (c := cells.get(str(k))) else "-"
                for k in ks) + " |")
    return lines


def crossover_shortfall(econ: dict) -> str | None:
    """The crossover goal in one sweep: None where it has no DFlash row or no EAGLE-3, '' where a DFlash row crosses
    over at a larger batch size than EAGLE-3 (met), else the figures ('dflash-b16 32, ... against EAGLE-3's 32')."""
    crossing = {name: econ[name]["crossover_batch_size"] or 10**9 for name in DFLASH_RUNS if name in econ}
    if not crossing or "eagle3-k7" not in econ:
        return None
    e, last = econ["eagle3-k7"], list(econ["eagle3-k7"]["speedup_by_batch_size"])[-1]
    if max(crossing.values()) > (e["crossover_batch_size"] or 10**9):
        return ""
    if e["crossover_batch_size"] is None and max(crossing.values()) == 10**9:  # neither crosses over: the sweep cannot tell
        return (f"neither DFlash nor EAGLE-3 crosses over within the sweep (B <= {last}; at B = {last} " +
                ", ".join(f"{name} {econ[name]['speedup_by_batch_size'][last]:.2f}x" for name in crossing) +
                f" against {e['speedup_by_batch_size'][last]:.2f}x), so a higher crossover is not shown")
    return ", ".join(f"{name} {econ[name]['crossover_batch_size'] or 'none within the sweep'}" for name in crossing) + \
        f" against EAGLE-3's {e['crossover_batch_size'] or f'none within the sweep (B <= {last})'}"


def _crossover(econ: dict | None, name: str) -> str:
    """'; its crossover in the batched sweep is X against EAGLE-3's Y' where the sweep ran the head, else ''; where the
    two differ, both speedups at the smaller of them (how far apart they are where one crosses over)."""
    if not econ or name not in econ:
        return ""
    cross, e3 = econ[name]["crossover_batch_size"], econ["eagle3-k7"]["crossover_batch_size"]
    text = f"; its crossover in the batched sweep is {cross or 'beyond the sweep'} against EAGLE-3's {e3 or 'beyond the sweep'}"
    at = str(min(b for b in (cross, e3) if b)) if cross != e3 and (cross or e3) else ""
    mine, theirs = econ[name].get("speedup_by_batch_size", {}), econ["eagle3-k7"].get("speedup_by_batch_size", {})
    if at in mine and at in theirs:
        text += f" ({mine[at]:.2f}x against {theirs[at]:.2f}x at B = {at})"
    return text


def _render_drafters(r: dict, rows: dict) -> list[str]:
    drafted = len(rows.get("dflash-b16", {}).get("acceptance_per_depth", []))  # the DFlash head's draft tokens
    lines = ["## Parallel drafting (DFlash, P-EAGLE) and EAGLE 3.1 + LK against EAGLE-3 (issue #31)", "",
             f"Each trained for the same wall-clock ({rows['eagle3-k7']['budget_seconds']:.0f} s) on the demo's data "
             f"({r.get('measured', {}).get('drafters', r['date'])}), then validated on the demo's 16 held-out prompts at "
             "batch size 1 with its recipe's tree: EAGLE-3 a chain of 8, DFlash one block of "
             f"{drafted + 1} ({drafted} draft tokens, one forward), P-EAGLE 8 tokens from one forward of its 2 layers. c is the draft's cost per drafted token over one "
             "target decode step (for the parallel drafters their one forward divided by the tokens it drafts, so that γ·c "
             "is a round's drafting cost for every kind). Side by side: after training, the heads decode the same prompts "
             "together, 5 passes in which every prompt runs plain and speculative decoding for each head in turn, the "
             "median pass counting (`side_by_side`: the machine's drift falls on every head alike, where one validation "
             "after another moved a head's speedup by up to 15%); the ratios below are of these.", "",
             "| drafter | train steps (s) | trainable params | tau | draft cost c | speedup vs plain (validation) "
             "| side by side | greedy exact |", "|---|---|---|---|---|---|---|---|"]
    for name, h in rows.items():
        lines.append(f"| {name} | {h['train_steps']} ({h['train_seconds']:.0f}) | {h['trainable_parameters'] / 1e6:.2f}M | "
                     f"{h['tau']:.2f} | {h['draft_to_target_cost_c']:.2f} | {h['speedup_vs_plain']:.2f}x | {_side(h)} | {h['exact']} |")
    econ = r.get("drafters_economics")
    if econ:
        lines += _render_sweep(r, econ)
    return lines + [""] + [f"- {g}." for g in _drafter_goals(r, rows, econ)] + [""]


def _drafter_goals(r: dict, rows: dict, econ: dict | None) -> list[str]:
    """The issue's goals (#31) read off section `drafters` and its sweep, one sentence each."""
    base, drafted = rows["eagle3-k7"], len(rows.get("dflash-b16", {}).get("acceptance_per_depth", []))
    goals = []
    if "dflash-b16" in rows:
        ratio = speed(rows["dflash-b16"]) / speed(base)
        goals.append(f"DFlash's speedup is {ratio:.2f}x EAGLE-3's (goal 1.3x: {'met' if ratio >= 1.3 else 'not met'}). A DFlash "
                     f"round drafts {drafted} tokens for {drafted * rows['dflash-b16']['draft_to_target_cost_c']:.2f} of a target step "
                     f"against EAGLE-3's {len(base['acceptance_per_depth']) * base['draft_to_target_cost_c']:.2f} for its "
                     f"chain of {len(base['acceptance_per_depth'])}, at tau {rows['dflash-b16']['tau']:.2f} against "
                     f"{base['tau']:.2f}" + (": every slot of a block is predicted from the context alone, which takes "
                     "more training than EAGLE-3's step-by-step drafts (the published drafts train for 6 epochs on ~800K "
                     "samples);" if rows["dflash-b16"]["tau"] < base["tau"] else ";") + " on a 2-core CPU the verify "
                     "forward of its 16 tokens, not drafting, dominates a round, which caps what a cheaper draft can gain")
    if econ and "dflash-b16" in econ:
        d, e3 = econ["dflash-b16"], econ["eagle3-k7"]
        first, cross = next(iter(d["speedup_by_batch_size"])), d["crossover_batch_size"]
        last = list(d["speedup_by_batch_size"])[-1]
        goals.append(f"In the batched sweep DFlash is {d['speedup_by_batch_size'][first] / e3['speedup_by_batch_size'][first]:.2f}x "
                     f"EAGLE-3's speedup at B = {first} (best K there: {d['best_k'][first]} against EAGLE-3's {e3['best_k'][first]}) and {d['speedup_by_batch_size'][last] / e3['speedup_by_batch_size'][last]:.2f}x "
                     f"at B = {last}; its crossover is {cross or 'beyond the sweep'} against EAGLE-3's "
                     f"{e3['crossover_batch_size'] or 'beyond the sweep'} (goal: a higher crossover: "
                     f"{'met' if (cross or 10**9) > (e3['crossover_batch_size'] or 10**9) else 'not met' if cross else 'not shown, as neither crosses over within the sweep'}). "
                     "Since 2026-12-03 every row's new context K/V and chain come from one batched call (a DFlash draft round "
                     "at B = 64 went from 53 to 24 ms); since 2026-12-05 a round at K drafts the block [root, MASK x K], as an "
                     "engine serving the head with num_speculative_tokens = K does, not all 16 slots (at K 3 and 7 tau moved "
                     "3.28 -> 3.27 and 4.76 -> 4.67 on a trial head)")
    if "dflash-b16+lk" in rows:
        lk = rows["dflash-b16+lk"]
        ratio = speed(lk) / speed(base)
        goals.append(f"DFlash trained with the LK loss (`head.objective: lk_lambda`): tau {lk['tau']:.2f}, "
                     f"{ratio:.2f}x EAGLE-3's speedup (goal 1.3x: {'met' if ratio >= 1.3 else 'not met'})")
        if econ and "dflash-b16+lk" in econ:
            goals[-1] += _crossover(econ, "dflash-b16+lk")
    for name, label in (("dflash-b8", "DFlash with blocks of 8 (7 draft tokens a round)"),
                        ("dflash-b8+dv", "DFlash with blocks of 8 over EAGLE-3's 1024-token draft vocabulary "
                                         "(`head.draft_vocab_size`)")):
        if name in rows:
            ratio = speed(rows[name]) / speed(base)
            goals.append(f"{label}: tau {rows[name]['tau']:.2f} in {rows[name]['train_steps']} steps, {ratio:.2f}x EAGLE-3's "
                         f"speedup (goal 1.3x: {'met' if ratio >= 1.3 else 'not met'})" + _crossover(econ, name))
    if "peagle" in rows:
        ratio = speed(rows["peagle"]) / speed(base)
        goals.append(f"P-EAGLE's speedup is {ratio:.2f}x EAGLE-3's at tau {rows['peagle']['tau']:.2f} against "
                     f"{base['tau']:.2f} (published: 1.10-1.36x over EAGLE-3 on gpt-oss and Qwen3-Coder)")
    if "eagle3.1+lk" in rows:
        gain = rows["eagle3.1+lk"]["tau"] - base["tau"]
        goals.append(f"EAGLE 3.1 + LK tau {rows['eagle3.1+lk']['tau']:.2f} against {base['tau']:.2f} "
                     f"(goal: at least EAGLE-3's: {'met' if gain >= 0 else 'not met'})" + _crossover(econ, "eagle3.1+lk"))
    second = r.get("drafters_qwen3") or {}
    if "eagle3.1+lk" in second:
        a, b = second["eagle3.1+lk"]["tau"], second["eagle3-k7"]["tau"]
        goals.append(f"on the second target EAGLE 3.1 + LK tau {a:.2f} against {b:.2f} ({'met' if a >= b else 'not met'} there), "
                     f"DFlash {speed(second['dflash-b16']) / speed(second['eagle3-k7']):.2f}x and "
                     f"P-EAGLE {speed(second['peagle']) / speed(second['eagle3-k7']):.2f}x EAGLE-3's "
                     "speedup: with 120 s of training the parallel drafters' later slots stay weak (their tau trails "
                     "EAGLE-3's on both targets)")
    return goals
