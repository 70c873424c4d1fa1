"""Regeneration: assistant turns replaced by the target's own answers, counted, resumable."""
import json

from conftest import micro_recipe
from draftsmith.data.regen import regenerate


def _convs(n):
    return [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Write function number {i}."},
                                         {"role": "assistant", "content": "original answer"},
                                         {"role": "user", "content": "And again?"},
                                         {"role": "assistant", "content": "second original"}]} for i in range(n)] + [
        {"id": "t", "text": "preformatted text is kept as it is"}]


def _counts(counts: dict) -> dict:
    return {k: counts[k] for k in ("input", "regenerated", "reused", "skipped", "failed")}


def test_regenerate_counts_and_resume(tmp_path, micro_target, tokenizer):
    recipe = micro_recipe(tmp_path, micro_target, "data.regen.max_new_tokens=6", "data.regen.batch_size=3")
    out = tmp_path / "regen.jsonl"  # the data stage names it by target fingerprint
    items = _convs(5)
    result, counts = regenerate(recipe, tokenizer, items, out)
    assert _counts(counts) == {"input": 6, "regenerated": 5, "reused": 0, "skipped": 1, "failed": 0}
    assert sum(counts["finish_reasons"].values()) == 10 and counts["via"] == "in-process"
    assert [r["id"] for r in result] == [c["id"] for c in items]
    for new, old in zip(result[:5], items[:5]):
        assert [m["role"] for m in new["messages"]] == [m["role"] for m in old["messages"]]
        assert new["messages"][0] == old["messages"][0] and new["messages"][2] == old["messages"][2]
        assert new["messages"][1]["content"] != "original answer"
    # a kill mid-write leaves a torn last line: that conversation is redone, the others reused
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:3]) + "\n" + lines[3][:10])
    again, counts = regenerate(recipe, tokenizer, items + _convs(7)[5:7], out)
    assert _counts(counts) == {"input": 8, "regenerated": 4, "reused": 3, "skipped": 1, "failed": 0}
    assert again[0] == result[0]
    assert len({json.loads(l)["id"] for l in out.read_text().splitlines() if l.startswith("{") and l.endswith("}")}) >= 7


def test_the_system_prompt_and_stop_strings_apply_to_what_the_target_is_asked(tmp_path, micro_target, tokenizer):
    """The target sees the recipe's system prompt (as the data stage renders it); answers end before a stop
    string, which is not kept (as servers return it); the stored record has no added system turn."""
    from draftsmith.data.conversations import cut_at_stop, with_system
    messages = [{"role": "user", "content": "hi"}]
    assert with_system(messages, "Be brief.") == [{"role": "system", "content": "Be brief."}] + messages
    assert with_system([{"role": "system", "content": "own"}] + messages, "Be brief.")[0]["content"] == "own"
    assert cut_at_stop("abc\ndef STOP ghi", ["STOP", "\n"]) == "abc" and cut_at_stop("abc", ["x"]) == "abc"
    recipe = micro_recipe(tmp_path, micro_target, "data.regen.max_new_tokens=6", "data.system_prompt=Be brief.")
    result, _ = regenerate(recipe, tokenizer, _convs(1)[:1], tmp_path / "regen.jsonl")
    assert result[0]["messages"][0]["role"] == "user"


def test_a_killed_replicas_turns_are_reused_and_folded_in(tmp_path, micro_target, tokenizer):
    """A data-parallel run killed before rank 0 folded the replicas' files: the next run (any layout)
    reads them as done, regenerates only the rest, and leaves one file with every conversation once."""
    recipe = micro_recipe(tmp_path, micro_target, "data.regen.max_new_tokens=4", "data.regen.batch_size=2")
    out = tmp_path / "regen.jsonl"
    items = _convs(4)
    first, _ = regenerate(recipe, tokenizer, items, out)
    lines = out.read_text().splitlines()
    out.write_text(lines[0] + "\n")                                            # replica 0 had written c0
    out.with_name("regen.replica1.jsonl").write_text(lines[1] + "\n" + lines[2][:7])  # replica 1: c1, then torn
    again, counts = regenerate(recipe, tokenizer, items, out)
    assert _counts(counts) == {"input": 5, "regenerated": 2, "reused": 2, "skipped": 1, "failed": 0}
    assert again == first
    assert not list(tmp_path.glob("*.replica*.jsonl"))
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == ["c0", "c1", "c2", "c3"]


def test_prompts_without_answers_are_answered_in_process(tmp_path, micro_target, tokenizer):
    """A conversation whose last turn is the user's gets the target's answer as one more turn (prompt sets,
    multi-turn conversations left waiting); conversations with answers keep their shape."""
    recipe = micro_recipe(tmp_path, micro_target, "data.regen.max_new_tokens=6", "data.regen.batch_size=2")
    items = [{"id": "p", "messages": [{"role": "user", "content": "Write a sort function."}]},
             {"id": "w", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                      {"role": "user", "content": "and then?"}]}] + _convs(1)
    result, counts = regenerate(recipe, tokenizer, items, tmp_path / "regen.jsonl")
    assert counts["regenerated"] == 3 and sum(counts["finish_reasons"].values()) == 1 + 2 + 2
    assert [m["role"] for m in result[0]["messages"]] == ["user", "assistant"]
    assert [m["role"] for m in result[1]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert [m["role"] for m in result[2]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert result[0]["messages"][0] == items[0]["messages"][0] and result[1]["messages"][2]["content"] == "and then?"
    assert result[1]["messages"][1]["content"] != "b"


def test_data_stage_answers_a_prompt_file_when_regenerating(tmp_path, micro_target):
    """{"prompt"} and Alpaca lines become training conversations with the target's answers under the loss."""
    from draftsmith.data.prepare import run_data
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Write a function that adds two numbers."}) + "\n"
                    + json.dumps({"instruction": "Reverse a list.", "input": "[1, 2, 3]"}) + "\n")
    recipe = micro_recipe(tmp_path, micro_target, "data.builtin=null", f"data.sources=[{{path: {path}}}]",
                          "data.heldout_fraction=0.0", "data.regen.enabled=true", "data.regen.max_new_tokens=8")
    manifest = run_data(recipe)
    assert manifest["num_train_conversations"] == 2 and manifest["num_loss_tokens"] >= 2  # at least each end of turn
    assert manifest["regeneration"]["regenerated"] == 2
    (answered,) = (recipe.run_dir / "data").glob("regen-*.jsonl")
    rows = [json.loads(line) for line in answered.read_text().splitlines()]
    assert sorted([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows) == [True, True]
