"""Reasoning and agent traces reach the chat template whole, and the loss mask covers what the target
produces (reasoning, tool calls, answers) and nothing it is shown (user turns, tool results). Golden
spans per template: Qwen3 thinking, gpt-oss harmony channels, DeepSeek-R1, a tool-calling conversation."""
import pytest

from conftest import template, write_jsonl
from draftsmith.data import conversations as conv

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
            "<|call|>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"]
QUESTION = [{"role": "user", "content": "What is 2+3?"}]
ANSWER = {"role": "assistant", "content": "It is 5.", "reasoning_content": "Add 2 and 3: 5."}
TOOLS = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
          "tool_calls": [{"type": "function", "id": "c1", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "sunny, 21 C"},
         {"role": "assistant", "content": "Sunny and 21 C.", "reasoning_content": "The tool said sunny."}]


def with_template(tokenizer, name: str):
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.bos_token = "<｜begin▁of▁sentence｜>"
    tokenizer.chat_template = template(name)
    return tokenizer


def masked(tokenizer, messages) -> tuple[str, list[str]]:
    from test_conversations import masked_spans
    ids, mask = conv.encode_conversation(tokenizer, {"id": "x", "messages": messages}, None)
    return tokenizer.decode(ids), masked_spans(tokenizer, ids, mask)


def test_qwen3_thinking_masks_reasoning_and_answer(tokenizer):
    tok = with_template(tokenizer, "qwen3")
    text, spans = masked(tok, QUESTION + [ANSWER])
    assert spans == ["<think>\nAdd 2 and 3: 5.\n</think>\n\nIt is 5.<|im_end|>"]
    assert text.startswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_earlier_turns_lose_their_reasoning_as_the_template_says(tokenizer):
    tok = with_template(tokenizer, "qwen3")
    first = {"role": "assistant", "content": "Four.", "reasoning_content": "2+2."}
    _, spans = masked(tok, [{"role": "user", "content": "2+2?"}, first] + QUESTION + [ANSWER])
    assert spans == ["Four.<|im_end|>", "<think>\nAdd 2 and 3: 5.\n</think>\n\nIt is 5.<|im_end|>"]


def test_qwen3_tool_calls_are_trained_and_tool_results_are_not(tokenizer):
    tok = with_template(tokenizer, "qwen3")
    text, spans = masked(tok, TOOLS)
    assert spans == ['<think>\nCall the tool.\n</think>\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
                     '</tool_call><|im_end|>',
                     "<think>\nThe tool said sunny.\n</think>\n\nSunny and 21 C.<|im_end|>"]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_gpt_oss_harmony_channels(tokenizer):
    tok = with_template(tokenizer, "gpt_oss")
    _, spans = masked(tok, QUESTION + [ANSWER])
    assert spans == ["<|channel|>analysis<|message|>Add 2 and 3: 5.<|end|><|start|>assistant<|channel|>final<|message|>"
                     "It is 5.<|return|>"]
    _, spans = masked(tok, TOOLS)
    assert spans[0] == ("<|channel|>analysis<|message|>Call the tool.<|end|><|start|>assistant to=functions.weather"
                        '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>')
    assert len(spans) == 2 and spans[1].endswith("Sunny and 21 C.<|return|>")


def test_deepseek_r1_reasoning_is_trained_as_the_target_produces_it(tokenizer):
    """R1's template reads no reasoning field and strips think blocks from every turn: the final turn is
    rendered as the target writes it after its generation prompt (which opens the think block)."""
    tok = with_template(tokenizer, "deepseek_r1")
    text, spans = masked(tok, QUESTION + [ANSWER])
    assert text == "<｜begin▁of▁sentence｜><｜User｜>What is 2+3?<｜Assistant｜><think>\nAdd 2 and 3: 5.\n</think>\n\nIt is 5.<｜end▁of▁sentence｜>"
    assert spans == ["Add 2 and 3: 5.\n</think>\n\nIt is 5.<｜end▁of▁sentence｜>"]
    _, spans = masked(tok, [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\n2+2\n</think>\n\nFour."}]
                      + QUESTION + [ANSWER])
    assert spans == ["Four.<｜end▁of▁sentence｜>", "Add 2 and 3: 5.\n</think>\n\nIt is 5.<｜end▁of▁sentence｜>"]


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning", "thinking"])
def test_every_field_a_template_reads_is_kept(key):
    record = {"messages": [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": None, key: "think", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
                           {"role": "tool", "content": "r", "tool_call_id": "c1", "name": "f"}]}
    messages = conv.normalize(record, "f:1")["messages"]
    assert messages[1] == {"role": "assistant", "content": "", "reasoning_content": "think",
                           "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    assert messages[2] == {"role": "tool", "content": "r", "tool_call_id": "c1", "name": "f"}


def test_bad_tool_calls_name_the_record():
    with pytest.raises(conv.DataError, match="f:7: turn 1 'tool_calls' must be a list"):
        conv.normalize({"messages": [{"role": "user", "content": "q"},
                                     {"role": "assistant", "content": "", "tool_calls": "f()"}]}, "f:7")


def test_data_stage_keeps_reasoning_through_to_the_mask(tmp_path, micro_target):
    from conftest import micro_recipe
    from draftsmith.data.prepare import load_train, run_data
    import json
    tokenizer_dir = tmp_path / "qwen3-like"
    import shutil
    shutil.copytree(micro_target, tokenizer_dir)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template("qwen3")
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in tokenizer_dir.glob("chat_template.*"):
        extra.unlink()
    path = write_jsonl(tmp_path / "r.jsonl", [{"id": f"r{i}", "messages": QUESTION + [dict(ANSWER, reasoning_content=f"step {i}")]}
                                             for i in range(3)])
    recipe = micro_recipe(tmp_path / "runs", tokenizer_dir, "data.builtin=null", f"data.sources=[{{path: {path}}}]",
                          "data.heldout_fraction=0.0")
    run_data(recipe)
    dataset, _ = load_train(recipe)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    row = dataset[0]
    trained = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert "step" in trained and "It is 5." in trained and "What is" not in trained
