"""Conversations -> loss masks for any chat template, input formats, and bad input."""
import json

import pytest

from conftest import template, write_jsonl
from draftsmith.data import conversations as conv
from draftsmith.data.prepare import run_data

GOLDEN = json.loads((__import__("pathlib").Path(__file__).parent / "golden" / "loss_masks.json").read_text())
CONVERSATIONS = {
    "two_turns": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
                  {"role": "user", "content": "Write add."},
                  {"role": "assistant", "content": "def add(a, b):\n    return a + b"}],
    "with_system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ok?"},
                    {"role": "assistant", "content": "Sure."}],
}
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]


def with_template(tokenizer, name: str):
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    if name == "llama3":
        tokenizer.bos_token = "<|begin_of_text|>"
    if name != "demo":
        tokenizer.chat_template = template(name)
    return tokenizer


def masked_spans(tokenizer, ids, mask) -> list[str]:
    spans, current = [], []
    for token, m in zip(ids + [None], mask + [0]):
        if m:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans


@pytest.mark.parametrize("name", ["llama3", "chatml", "demo", "think"])
@pytest.mark.parametrize("conv_name", list(CONVERSATIONS))
def test_loss_mask_golden(tokenizer, name, conv_name):
    tok = with_template(tokenizer, name)
    ids, mask = conv.encode_conversation(tok, {"id": "x", "messages": CONVERSATIONS[conv_name]}, None)
    assert len(ids) == len(mask)
    assert masked_spans(tok, ids, mask) == GOLDEN[name][conv_name]


def test_system_prompt_from_recipe_is_unmasked(tokenizer):
    tok = with_template(tokenizer, "chatml")
    messages = CONVERSATIONS["two_turns"]
    ids, mask = conv.encode_conversation(tok, {"id": "x", "messages": messages}, "Answer in Python.")
    text = tok.decode(ids)
    assert "Answer in Python." in text
    assert all("Answer" not in s for s in masked_spans(tok, ids, mask))


def test_history_rewriting_template_masks_each_turn(tokenizer):
    """A Qwen3-style template drops reasoning from earlier turns: the mask still covers exactly
    what is rendered of each assistant turn."""
    tok = with_template(tokenizer, "think")
    messages = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>hmm</think>\nA1"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "<think>so</think>\nA2"}]
    ids, mask = conv.encode_conversation(tok, {"id": "x", "messages": messages}, None)
    assert masked_spans(tok, ids, mask) == ["A1<|im_end|>", "<think>so</think>\nA2<|im_end|>"]


def test_normalize_forms():
    share = conv.normalize({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}, "f:1")
    openai = conv.normalize({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "f:2")
    assert share["messages"] == openai["messages"]
    assert conv.normalize({"text": "raw"}, "f:3") == {"id": "f:3", "text": "raw"}
    with pytest.raises(conv.DataError, match="f:4"):
        conv.normalize({"question": "x"}, "f:4")


def test_prompt_shapes_normalize_to_user_turns():
    """The usual prompt-set shapes: {"prompt"}, Alpaca with and without an answer, user-only messages, ShareGPT."""
    user = [{"role": "user", "content": "Sort a list."}]
    assert conv.normalize({"prompt": "Sort a list."}, "p:1")["messages"] == user
    assert conv.normalize({"instruction": "Sort a list.", "input": ""}, "p:2")["messages"] == user
    alpaca = conv.normalize({"instruction": "Sort", "input": "[3, 1]", "output": "[1, 3]"}, "p:3")["messages"]
    assert alpaca == [{"role": "user", "content": "Sort\n\n[3, 1]"}, {"role": "assistant", "content": "[1, 3]"}]
    assert conv.normalize({"messages": user}, "p:4")["messages"] == user
    assert conv.normalize({"conversations": [{"from": "human", "value": "Sort a list."}]}, "p:5")["messages"] == user
    assert conv.normalize({"prompt": "x", "domain": "code"}, "p:6")["domain"] == "code"
    assert conv.to_answer(user) == user + [{"role": "assistant", "content": ""}]
    assert conv.to_answer(alpaca) == alpaca
    with pytest.raises(conv.DataError, match="p:7.*non-empty"):
        conv.normalize({"prompt": "  "}, "p:7")


def _recipe(tmp_path, micro_target, *overrides):
    from conftest import micro_recipe
    return micro_recipe(tmp_path / "runs", micro_target, "data.builtin=null", *overrides)


def test_data_stage_formats_and_counts(tmp_path, micro_target):
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
        {"id": "b", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y = 1"}]},
        '{"id": "broken", "messages": [',
        {"id": "d", "text": "def f():\n    return 1\n"},
    ])
    recipe = _recipe(tmp_path, micro_target, f"data.sources=[{{path: {path}}}]", "data.heldout_fraction=0.0")
    manifest = run_data(recipe)
    assert manifest["num_train_conversations"] == 3
    assert manifest["num_skipped"] == {"malformed_json": 1}
    assert manifest["skip_examples"]["malformed_json"] == f"{path}:3"
    assert manifest["num_records_read"] == 4


def test_prompt_without_answer_is_refused_without_regeneration(tmp_path, micro_target):
    """One line naming the file and line, the record and the key to set; nothing is written."""
    path = write_jsonl(tmp_path / "prompts.jsonl", [
        {"id": "a", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y = 1"}]},
        {"id": "c", "prompt": "only a question"}])
    recipe = _recipe(tmp_path, micro_target, f"data.sources=[{{path: {path}}}]", "data.heldout_fraction=0.0")
    with pytest.raises(conv.DataError, match=rf"^{path}:2: record 'c' is a prompt without an answer.*data.regen.enabled: true"):
        run_data(recipe)
    assert not (recipe.run_dir / "data" / "manifest.json").exists()


def test_malformed_line_fails_with_file_and_line(tmp_path, micro_target):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, "{not json"])
    recipe = _recipe(tmp_path, micro_target, f"data.sources=[{{path: {path}}}]", "data.bad_lines=fail")
    with pytest.raises(conv.DataError, match=rf"{path}:2: malformed JSON"):
        run_data(recipe)
    assert not (recipe.run_dir / "data" / "manifest.json").exists()


def test_missing_data_file(tmp_path, micro_target):
    recipe = _recipe(tmp_path, micro_target, f"data.sources=[{{path: {tmp_path}/nope.jsonl}}]")
    with pytest.raises(conv.DataError, match="nope.jsonl.*does not exist"):
        run_data(recipe)


def test_max_length_drop_policy(tmp_path, micro_target):
    long = {"id": "long", "messages": [{"role": "user", "content": "a " * 400}, {"role": "assistant", "content": "b"}]}
    short = {"id": "short", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [long, short])
    recipe = _recipe(tmp_path, micro_target, f"data.sources=[{{path: {path}}}]", "data.overflow=drop",
                     "data.heldout_fraction=0.0")
    manifest = run_data(recipe)
    assert manifest["num_skipped"] == {"too_long": 1} and manifest["num_train_conversations"] == 1


def test_tokenizer_without_chat_template(tmp_path, micro_target):
    import json as j
    import shutil
    target = tmp_path / "no_template"
    shutil.copytree(micro_target, target)
    config = j.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(j.dumps(config))
    for extra in target.glob("chat_template.*"):
        extra.unlink()
    recipe = _recipe(tmp_path, target, "data.builtin=stdlib")
    with pytest.raises(conv.DataError, match="no chat template"):
        run_data(recipe)


def test_missing_model_directory(tmp_path, micro_target):
    recipe = _recipe(tmp_path, tmp_path / "runs" / "no-such-model", "data.builtin=stdlib")
    with pytest.raises(ValueError, match="no-such-model.*config.json"):
        run_data(recipe)


def test_hf_datasets_source(tmp_path, micro_target):
    import datasets
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}] * 4
                               ).save_to_disk(str(saved))
    recipe = _recipe(tmp_path, micro_target, f"data.sources=[{{path: {saved}}}]", "data.heldout_fraction=0.0")
    assert run_data(recipe)["num_train_conversations"] == 4


def test_stdlib_split_is_by_module(micro_target, tmp_path):
    from draftsmith.targets import stdlib
    from draftsmith.data.prepare import collect
    recipe = _recipe(tmp_path, micro_target, "data.builtin=stdlib", "data.max_conversations=null")
    train, heldout, _ = collect(recipe, conv.SkipCounter())
    train_modules = {c["id"].split(":")[0] for c in train}
    heldout_modules = {c["id"].split(":")[0] for c in heldout}
    assert train and heldout and not train_modules & heldout_modules
    assert all(stdlib.is_heldout(m, recipe.data.heldout_fraction) for m in heldout_modules)


def _rows(tag: str, n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"{tag} q{i}"}, {"role": "assistant", "content": "a"}]} for i in range(n)]


def test_a_sources_split_is_honoured_and_a_missing_one_named(tmp_path):
    import datasets
    from draftsmith.recipe import DataSource
    saved = tmp_path / "ultrachat-like"
    datasets.DatasetDict({"train_sft": datasets.Dataset.from_list(_rows("sft", 3)),
                          "test_sft": datasets.Dataset.from_list(_rows("test", 2))}).save_to_disk(str(saved))
    read = lambda **kw: [r for _, r in conv.read_records(str(saved), "fail", conv.SkipCounter(), DataSource(path=str(saved), **kw))]  # noqa: E731
    assert [r["messages"][0]["content"] for r in read(split="train_sft")] == ["sft q0", "sft q1", "sft q2"]
    assert len(read(split="test_sft")) == 2
    with pytest.raises(conv.DataError, match=r"no split 'train' \(it has \['test_sft', 'train_sft'\]\)"):
        read()


def test_a_sources_configuration_name_and_streaming(tmp_path):
    """A local dataset folder with two configurations (declared in its README, as hub datasets do), one
    chosen by name, read whole and streamed record by record."""
    from draftsmith.recipe import DataSource
    root = tmp_path / "multi"
    for name in ("short", "long"):
        (root / name).mkdir(parents=True)
        write_jsonl(root / name / "train.jsonl", _rows(name, 2 if name == "short" else 3))
    (root / "README.md").write_text("---\nconfigs:\n- config_name: short\n  data_files:\n  - split: train\n    path: short/*.jsonl\n"
                                    "- config_name: long\n  data_files:\n  - split: train\n    path: long/*.jsonl\n---\n")
    for streaming in (False, True):
        source = DataSource(path=str(root), name="long", streaming=streaming)
        records = [r for _, r in conv.read_records(str(root), "fail", conv.SkipCounter(), source)]
        assert [r["messages"][0]["content"] for r in records] == ["long q0", "long q1", "long q2"]
    with pytest.raises(conv.DataError, match=r"split 'nope'.*cannot load"):
        list(conv.read_records(str(root), "fail", conv.SkipCounter(), DataSource(path=str(root), name="short", split="nope")))
