"""The economics formulas against reference values (issue #14) and the schedule writer on a synthetic sweep."""
import pytest

from draftsmith.runtime import economics as E


def test_theorem_3_8_and_break_even_reference_values():
    assert E.expected_tokens(0.75, 4) == pytest.approx(3.0508, abs=1e-4)
    assert E.break_even_cost(E.expected_tokens(0.75, 4), 4) == pytest.approx(0.512695, abs=1e-6)
    assert E.expected_tokens(1.0, 4) == 5 and E.expected_tokens(0.0, 4) == 1
    assert E.alpha_from_tau(3.0508, 4) == pytest.approx(0.75, abs=1e-4)
    assert E.walltime_factor(3.0508, 4, 0.5127) == pytest.approx(1.0, abs=1e-3)   # at c* speculation breaks even


def test_cost_reference_values():
    assert E.usd_per_million_tokens(2.0, 45) == pytest.approx(12.35, abs=0.005)
    assert E.usd_per_million_tokens(2.0, 45 * 1.8) == pytest.approx(6.86, abs=0.005)
    assert E.break_even_extra_usd_per_hour(2.0, 1.8) == pytest.approx(1.60)
    with pytest.raises(ValueError, match="tokens_per_s"):
        E.usd_per_million_tokens(2.0, 0)


def test_schedule_from_a_synthetic_sweep():
    """Speculation wins at low batch, loses past the crossover: K falls with the batch size, then 0."""
    sweep = {1: {0: 40, 1: 60, 2: 75, 4: 90}, 2: {0: 80, 1: 115, 2: 140, 4: 150}, 4: {0: 150, 1: 200, 2: 230, 4: 210},
             8: {0: 300, 1: 360, 2: 340, 4: 290}, 16: {0: 560, 1: 540, 2: 500, 4: 420}, 32: {0: 900, 1: 800, 2: 700, 4: 600}}
    assert E.schedule(sweep) == [[1, 3, 4], [4, 7, 2], [8, 15, 1], [16, 32, 0]]
    assert E.schedule({1: {0: 10, 2: 10}}) == [[1, 1, 0]]          # a tie keeps the cheaper K
    with pytest.raises(ValueError, match="empty sweep"):
        E.schedule({})


def test_validate_prompts_file_domains_and_the_screen(tmp_path, micro_pipeline):
    """`validate.prompts`: conversations and plain prompts with domains; the screen reports tau and alpha per
    domain and per input-length bucket, Theorem 3.8's prediction and c*; bad files are named."""
    import json
    from conftest import micro_recipe
    from draftsmith.runtime.validate import run_validate
    lines = [{"prompt": "Write a function that reverses a list.", "domain": "code"},
             {"messages": [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "ignored"}], "domain": "code"},
             {"conversations": [{"from": "human", "value": "Explain what a dict is."}], "domain": "prose"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    recipe = micro_pipeline
    over = [f"validate.prompts={path}", "validate.num_prompts=3", "validate.max_new_tokens=12"]
    r = micro_recipe(recipe.out_dir, recipe.target.model, *over)
    assert run_validate(r, out=str(tmp_path / "v"))["exact_match"]
    screen = json.loads((tmp_path / "v" / "validation.json").read_text())["screen"]
    assert set(screen["per_domain"]) == {"code", "prose"} and screen["per_domain"]["code"]["num_prompts"] == 2
    assert sum(g["num_prompts"] for g in screen["per_input_length"].values()) == 3
    tau, gamma = screen["tau"], screen["gamma"]
    assert screen["break_even_c"] == pytest.approx((tau - 1) / gamma)
    assert screen["predicted_walltime_factor"] == pytest.approx(tau / (gamma * screen["c"] + 1))
    assert E.expected_tokens(screen["alpha_iid"], gamma) == pytest.approx(max(tau, 1.0), abs=1e-6)  # no rounds: tau 0, alpha 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        run_validate(micro_recipe(recipe.out_dir, recipe.target.model, f"validate.prompts={bad}"), out=str(tmp_path / "w"))
    with pytest.raises(ValueError, match="validate.prompts=.*no such file"):
        run_validate(micro_recipe(recipe.out_dir, recipe.target.model, f"validate.prompts={tmp_path / 'nope.jsonl'}"), out=str(tmp_path / "w"))
