"""The bench's side-by-side measurement of trained heads (`bench.heads.side_by_side`)."""
import copy
import json
from pathlib import Path

import pytest

from draftsmith.bench.heads import side_by_side, speed


def _short(recipe):
    recipe = copy.deepcopy(recipe)
    recipe.validate.num_prompts, recipe.validate.max_new_tokens = 3, 12
    return recipe


@pytest.mark.long
def test_heads_are_timed_side_by_side_over_several_passes(micro_pipeline):
    recipe = _short(micro_pipeline)
    out = side_by_side({"first": recipe, "second": recipe}, repeats=3)
    assert set(out) == {"first", "second"}
    for row in out.values():
        assert len(row["passes"]) == 3 and all(p > 0 for p in row["passes"])
        assert row["speedup"] == sorted(row["passes"])[1]  # the median pass


def test_side_by_side_refuses_a_head_whose_output_differs_from_plain(micro_pipeline, monkeypatch):
    from draftsmith.runtime import generate
    real = generate.speculative_generate

    def wrong(*args, **kwargs):
        result = real(*args, **kwargs)
        result.tokens = [t + 1 for t in result.tokens]
        return result
    monkeypatch.setattr(generate, "speculative_generate", wrong)
    with pytest.raises(RuntimeError, match="only: speculative output differs from plain decoding on prompt 0"):
        side_by_side({"only": _short(micro_pipeline)}, repeats=1)


def test_the_side_by_side_speedup_is_the_one_compared():
    assert speed({"speedup_vs_plain": 1.5, "speedup_side_by_side": 1.7}) == 1.7
    assert speed({"speedup_vs_plain": 1.5}) == 1.5


def test_the_dflash_goals_read_every_dflash_row():
    from draftsmith.bench.__main__ import _shortfalls
    from draftsmith.bench.heads import dflash_ratios

    def row(speedup):
        return {"speedup_vs_plain": speedup, "budget_seconds": 120.0}

    def crossing(batch_size):
        return {"crossover_batch_size": batch_size, "speedup_by_batch_size": {"1": 2.0, "128": 0.9}}

    def goals(drafters, econ):
        r = {"capture": {"compact-bf16": {"ratio_vs_specforge": 0.4, "ratio_vs_plain_forward": 1.0},
                         "compact-fp8": {"ratio_vs_specforge": 0.2}},
             "runtime": {"speedup_vs_hf_generate": 2.5, "speedup_vs_plain": 2.0, "tau": 5.0},
             "drafters": drafters, "drafters_economics": econ}
        return "\n".join(_shortfalls(r))
    short = {"eagle3-k7": row(2.0), "dflash-b16": row(2.4), "dflash-b16+lk": row(2.5)}
    assert dflash_ratios(short) == pytest.approx({"dflash-b16": 1.2, "dflash-b16+lk": 1.25})
    text = goals(short, {"eagle3-k7": crossing(128), "dflash-b16": crossing(128), "dflash-b16+lk": crossing(64)})
    assert "dflash-b16 1.20x, dflash-b16+lk 1.25x EAGLE-3's speedup at 120 s" in text
    assert "crossover batch size: dflash-b16 128, dflash-b16+lk 64 against EAGLE-3's 128" in text
    met = goals(short | {"dflash-b16+lk": row(2.7)}, {"eagle3-k7": crossing(128), "dflash-b16": crossing(128),
                                                       "dflash-b16+lk": crossing(256)})
    assert "DFlash" not in met  # 1.35x and a crossover of 256 by the LK row: both goals met
    beyond = goals(short, {"eagle3-k7": crossing(None), "dflash-b16": crossing(128), "dflash-b16+lk": crossing(64)})
    assert "dflash-b16 128, dflash-b16+lk 64 against EAGLE-3's none within the sweep (B <= 128)" in beyond
    neither = goals(short, {"eagle3-k7": crossing(None), "dflash-b16": crossing(128), "dflash-b16+lk": crossing(None)})
    assert "neither DFlash nor EAGLE-3 crosses over within the sweep" in neither


def test_the_crossover_goal_reads_the_sweep_of_the_larger_budget_too():
    """Sections drafters_budget and drafters_budget_economics: the crossover goal is met where a DFlash row crosses
    over later than EAGLE-3 in either sweep; not met, both sweeps' figures are listed with their training budgets."""
    from draftsmith.bench.__main__ import _shortfalls
    from draftsmith.bench.heads import _render_budget, crossover_shortfall

    def crossing(batch_size):
        return {"crossover_batch_size": batch_size, "speedup_by_batch_size": {"1": 2.0, "128": 0.9},
                "by_k": {"1": {}, "128": {}}}

    def rows(seconds):
        row = {"speedup_vs_plain": 2.0, "budget_seconds": seconds, "train_steps": 10, "train_seconds": seconds, "tau": 4.0,
               "draft_to_target_cost_c": 0.1, "exact": "16/16"}
        return {"eagle3-k7": row, "dflash-b8": row | {"speedup_vs_plain": 2.4}}
    short = {"eagle3-k7": crossing(32), "dflash-b8": crossing(32)}
    r = {"capture": {"compact-bf16": {"ratio_vs_specforge": 0.4, "ratio_vs_plain_forward": 1.0},
                     "compact-fp8": {"ratio_vs_specforge": 0.2}},
         "runtime": {"speedup_vs_hf_generate": 2.5, "speedup_vs_plain": 2.0, "tau": 5.0}, "date": "today",
         "drafters": rows(120.0), "drafters_economics": short, "drafters_budget": rows(480.0)}
    assert crossover_shortfall(short) == "dflash-b8 32 against EAGLE-3's 32"
    assert crossover_shortfall({"eagle3-k7": crossing(32), "dflash-b8": crossing(64)}) == ""
    assert crossover_shortfall({"eagle3-k7": crossing(32)}) is None
    alike = r | {"drafters_budget_economics": {"eagle3-k7": crossing(64), "dflash-b8": crossing(64)}}
    assert ("DFlash's crossover batch size: dflash-b8 32 against EAGLE-3's 32 at 120 s of training each; dflash-b8 64 "
            "against EAGLE-3's 64 at 480 s of training each (goal: higher)") in "\n".join(_shortfalls(alike))
    assert "(goal: a higher crossover: not met)" in "\n".join(_render_budget(alike))
    later = r | {"drafters_budget_economics": {"eagle3-k7": crossing(32), "dflash-b8": crossing(128)}}
    assert "crossover" not in "\n".join(_shortfalls(later))
    text = "\n".join(_render_budget(later))
    assert "| dflash-b8 | 2.00x | 0.90x | 128 |" in text
    assert "At this budget dflash-b8 crosses over at 128 against EAGLE-3's 32 (goal: a higher crossover: met)" in text


def test_the_drafters_goals_name_each_rows_crossover_and_the_machine_of_each_section():
    from draftsmith.bench.heads import _crossover, _machine
    econ = {"eagle3-k7": {"crossover_batch_size": 32}, "eagle3.1+lk": {"crossover_batch_size": 64},
            "dflash-b8": {"crossover_batch_size": None}}
    assert _crossover(econ, "eagle3.1+lk") == "; its crossover in the batched sweep is 64 against EAGLE-3's 32"
    assert _crossover(econ, "dflash-b8").endswith("beyond the sweep against EAGLE-3's 32")
    assert _crossover(econ, "peagle") == "" and _crossover(None, "dflash-b8") == ""
    econ["eagle3-k7"]["speedup_by_batch_size"] = {"32": 0.998}
    econ["eagle3.1+lk"]["speedup_by_batch_size"] = {"32": 1.04}
    assert _crossover(econ, "eagle3.1+lk").endswith("64 against EAGLE-3's 32 (1.04x against 1.00x at B = 32)")
    r = {"date": "2026-12-01, AMD EPYC", "measured": {"drafters": "2026-12-06, Intel Xeon, 2 threads"}}
    assert (_machine(r, "drafters"), _machine(r, "drafters_budget")) == ("Intel Xeon", "AMD EPYC")


def test_the_sweep_renders_each_heads_k_at_the_deciding_batch_size():
    """Section drafters_economics: per head and K at B = 128, the speedup, tau and a round's draft / verify time; a K
    a head cannot draft (blocks of 8: no K = 15) shows as '-'."""
    from draftsmith.bench.heads import PLAIN_BASELINE, _render_sweep

    def head(by_k):
        return {"speedup_by_batch_size": {"1": 2.0, "128": 1.1}, "crossover_batch_size": None,
                "by_k": {"1": by_k, "128": by_k}}
    cell = {"speedup": 1.1, "tau": 3.4, "draft_ms": 12.0, "verify_ms": 37.25}
    econ = {"eagle3-k7": head({"3": cell, "15": cell | {"speedup": 0.8}}), "dflash-b8": head({"3": cell})}
    text = "\n".join(_render_sweep({"date": "today"}, econ))
    assert "| drafter | K = 3 | K = 15 |" in text
    assert "| eagle3-k7 | 1.10x, tau 3.40, 12.0 / 37.2 ms | 0.80x, tau 3.40, 12.0 / 37.2 ms |" in text
    assert "| dflash-b8 | 1.10x, tau 3.40, 12.0 / 37.2 ms | - |" in text
    assert "Measured before plain batched decoding lost its per-row host steps" in text  # rows without the one-pass baseline
    current = {name: h | {"plain_baseline": PLAIN_BASELINE} for name, h in econ.items()}
    assert "Measured before" not in "\n".join(_render_sweep({"date": "today"}, current))


def _fails():
    raise ValueError("the job failed")


def _writes(path):
    from pathlib import Path
    Path(path).write_text("done")


def test_a_job_in_a_fresh_process_runs_and_its_failure_is_raised(tmp_path):
    """The drafters' sweep runs in a process of its own (`in_fresh_process`): its work lands, and a failure there
    stops the bench instead of passing unnoticed."""
    from draftsmith.bench.common import in_fresh_process
    in_fresh_process(_writes, str(tmp_path / "out"))
    assert (tmp_path / "out").read_text() == "done"
    with pytest.raises(RuntimeError, match="_fails failed in its own process"):
        in_fresh_process(_fails)


def test_real_target_section_renders_tau_per_domain_and_both_speedups():
    from draftsmith.bench.real_target import REAL_RUNS, render_real_target
    assert {"eagle3", "eagle3.1+lk", "dflash-b8+dv", "peagle", "eagle2", "medusa1", "mtp"} == set(REAL_RUNS)
    row = {"train_steps": 40, "tau": 1.5, "acceptance_per_depth": [0.4, 0.25], "speedup_vs_plain": 1.1, "exact": "12/12",
           "speedup_vs_hf_generate": 1.05, "exact_vs_generate": "12/12", "budget_seconds": 240.0,
           "per_domain": {"humaneval": {"tau": 1.25}, "math": {"tau": 1.9}}}
    lines = render_real_target({"date": "2026-12-07", "machine": "a CPU", "real_target": {"eagle3": row},
                                "measured": {"real_target": "2026-12-07, a CPU, 2 threads"}})
    table = "\n".join(lines)
    assert "| head | steps | tau | tau humaneval | tau math |" in table
    assert "| eagle3 | 40 | 1.50 | 1.25 | 1.90 | 0.40 0.25 | 1.10x | 1.05x | 12/12 |" in table
    assert render_real_target({"date": "x", "machine": "y"}) == []


def test_real_kinds_remeasure_some_rows_and_keep_the_others_in_order():
    from draftsmith.bench.__main__ import _kinds
    from draftsmith.bench.real_target import merge_rows
    kept = {"mtp": {"tau": 1.3}, "eagle3": {"tau": 1.2}, "eagle2": {"tau": 1.0}}
    merged = merge_rows(kept, {"eagle2": {"tau": 1.4}})
    assert list(merged) == ["eagle3", "eagle2", "mtp"] and merged["eagle2"]["tau"] == 1.4 and merged["mtp"]["tau"] == 1.3
    assert list(_kinds("mtp,eagle2")) == ["mtp", "eagle2"]
    with pytest.raises(SystemExit, match="unknown.*'eagle9'"):
        _kinds("eagle9")


def test_vlm_section_renders_tau_for_image_and_text_prompts_and_flags_a_missed_goal():
    from draftsmith.bench.__main__ import _shortfalls
    from draftsmith.bench.vlm import render_vlm
    stats = {"tau": 2.8, "acceptance_per_depth": [0.7, 0.5], "speedup_vs_plain": 1.2, "speedup_vs_hf_generate": 1.1, "num_prompts": 12}
    row = {"tau_image": 2.8, "tau_text": 3.1, "exact_vs_generate": "24/24",
           "per_domain": {"image": stats, "text": {**stats, "tau": 3.1}},
           "target": {"num_parameters": 2.1e6, "train_steps": 800, "train_seconds": 900.0,
                      "image_reading": {"prompts": 32, "char_accuracy": 0.41, "first_line_exact": 0.12}}}
    table = "\n".join(render_vlm({"date": "2026-12-07", "machine": "a CPU", "vlm": row}))
    assert "| image | 12 | 2.80 | 0.70 0.50 | 1.20x | 1.10x |" in table and "| text | 12 | 3.10 |" in table
    assert "0.41 of the drawn signature's characters" in table and "tau_image 2.80 (goal 2.5: met)" in table
    measured = json.loads((Path(__file__).parent.parent / "BENCHMARKS.json").read_text())  # the other sections as kept
    missed = "\n".join(_shortfalls({**measured, "vlm": {**row, "tau_image": 1.9}}))
    assert "tau on image prompts 1.90 (goal 2.5)" in missed
    assert "image prompts" not in "\n".join(_shortfalls({**measured, "vlm": row}))
    assert render_vlm({"date": "x", "machine": "y"}) == []


def test_real_recipe_section_renders_every_domain_and_flags_the_missed_goals():
    from draftsmith.bench.__main__ import _shortfalls
    from draftsmith.bench.real_target import render_real_recipe
    stats = {"tau": 1.5, "acceptance_per_depth": [0.4, 0.5], "speedup_vs_plain": 1.1, "speedup_vs_hf_generate": 1.05, "num_prompts": 8}
    row = {**stats, "num_prompts": 24, "epochs": 4.0, "exact_vs_generate": "24/24", "plain_vs_generate": 0.96,
           "per_domain": {"humaneval": {**stats, "tau": 1.36}, "math": {**stats, "tau": 2.17}}}
    table = "\n".join(render_real_recipe({"measured": {"real_recipe": "2026-12-07, a CPU"}, "real_recipe": row}))
    assert "| all | 1.50 | 0.40 0.50 | 1.10x | 1.05x |" in table and "| humaneval | 1.36 |" in table
    assert "4 epochs" in table and "0.96x HF `generate`" in table and "24/24" in table
    measured = json.loads((Path(__file__).parent.parent / "BENCHMARKS.json").read_text())  # the other sections as kept
    missed = "\n".join(_shortfalls({**measured, "real_recipe": row}))
    assert "tau on HumanEval 1.36 (goal 2.5)" in missed and "plain decoding in the runtime 0.96x" in missed
    met = {**row, "acceptance_per_depth": [0.7, 0.8], "speedup_vs_hf_generate": 1.4,
           "per_domain": {"humaneval": {**stats, "tau": 2.6}}}
    assert "shipped recipe" not in "\n".join(_shortfalls({**measured, "real_recipe": met}))
    assert render_real_recipe({}) == []
