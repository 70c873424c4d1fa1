"""The builtin prompt sets (HumanEval from its package; code, math and chat built offline) and the data
stage reading them as sources."""
import ast

import pytest

from draftsmith.data import prompt_sets


def _texts(records):
    return {r["messages"][0]["content"] for r in records}


def test_humaneval_is_read_from_its_package_and_held_out():
    records = prompt_sets.load("builtin:humaneval", "test")
    assert len(records) == 164 and all(r["domain"] == "humaneval" for r in records)
    assert "def has_close_elements" in records[0]["messages"][0]["content"]
    with pytest.raises(ValueError, match="held out for evaluation"):
        prompt_sets.load("builtin:humaneval", "train")


@pytest.mark.parametrize("name", ["code", "code-complete", "math", "chat"])
def test_built_sets_are_deterministic_and_their_splits_disjoint(name):
    train, test = prompt_sets.load(f"builtin:{name}", "train"), prompt_sets.load(f"builtin:{name}", "test")
    assert len(test) >= 40 and len(train) >= 3 * len(test) // 2
    assert not _texts(train) & _texts(test)
    assert prompt_sets.load(f"builtin:{name}", "test") == test
    assert len(_texts(test)) == len(test) and {r["domain"] for r in train} == {name.split("-")[0]}
    assert all([m["role"] for m in r["messages"]] == ["user"] for r in train[:50])


def test_code_complete_asks_as_humaneval_asks():
    """In-domain prompts for HumanEval: the stdlib's functions cut after their docstring, in HumanEval's wording."""
    humaneval = prompt_sets.load("builtin:humaneval", "test")[0]["messages"][0]["content"]
    records = prompt_sets.load("builtin:code-complete", "train")
    wording = humaneval.split("```python")[0]
    for record in records[:200]:
        text = record["messages"][0]["content"]
        assert text.startswith(wording) and text.endswith("\n```"), text
        code = text.split("```python\n")[1].removesuffix("\n```")
        doc_line = next(line for line in code.splitlines()[1:] if line.strip() and line.lstrip()[0] in "\"'rRuU")
        indent = doc_line[:len(doc_line) - len(doc_line.lstrip())]
        function = ast.parse(f"{code}\n{indent}pass\n").body[0]  # a whole signature and docstring: only the body is left
        assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) and not function.decorator_list
        assert ast.get_docstring(function) and len(function.body) == 2, code
    assert len(records) >= 0.9 * len(prompt_sets.load("builtin:code", "train"))  # the functions `code` asks for


def test_chat_test_topics_are_never_trained_on():
    train = " ".join(_texts(prompt_sets.load("builtin:chat", "train")))
    test_topics = [t for t in prompt_sets.CHAT_TOPICS if prompt_sets._topic_split(t) == "test"]
    assert test_topics and not any(f" {topic}" in train for topic in test_topics if len(topic) > 8)


def test_unknown_set_and_split_are_named():
    with pytest.raises(ValueError, match="'builtin:poetry': no such builtin prompt set.*builtin:humaneval"):
        prompt_sets.load("builtin:poetry")
    with pytest.raises(ValueError, match="split 'dev'"):
        prompt_sets.load("builtin:math", "dev")


def test_data_stage_reads_builtin_sources_with_a_record_limit(tmp_path, micro_target):
    """Prompt sets as data sources, `max_records` of each; prompts go to regeneration (here refused without it)."""
    from conftest import micro_recipe
    from draftsmith.data.conversations import DataError
    from draftsmith.data.prepare import collect
    from draftsmith.data.conversations import SkipCounter
    recipe = micro_recipe(tmp_path, micro_target, "data.builtin=null", 'data.sources=[{path: "builtin:math", max_records: 7}, '
                          '{path: "builtin:chat", max_records: 3}]', "data.heldout_fraction=0.0")
    train, heldout, num_read = collect(recipe, SkipCounter(), answering=True)
    assert num_read == 10 and len(train) == 10 and not heldout
    assert [c["domain"] for c in train] == ["math"] * 7 + ["chat"] * 3
    with pytest.raises(DataError, match=r"builtin:math\[0\]: record 'math-train-0' is a prompt without an answer"):
        collect(recipe, SkipCounter(), answering=False)
