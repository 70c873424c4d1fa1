"""The bench's side-by-side measurement of trained heads (`bench.heads.side_by_side`)."""
import copy

import pytest

from draftsmith.bench.heads import side_by_side, speed


def _short(recipe):
    recipe = copy.deepcopy(recipe)
    recipe.validate.num_prompts, recipe.validate.max_new_tokens = 3, 12
    return recipe


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
