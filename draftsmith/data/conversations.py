"""Conversations -> tokens + assistant-only loss mask, rendered with the target's own chat template.

Inputs: JSONL/JSON in ShareGPT (`conversations`/`from`/`value`), OpenAI (`messages`/`role`/`content`),
preformatted (`text`), prompt (`prompt`) or Alpaca (`instruction`, `input`, optional `output`) form, or
anything `datasets.load_dataset`/`load_from_disk` reads. A conversation whose last turn is the user's
(a prompt set: no answer yet) is answered by the target when regeneration is on.

Reasoning and agent traces reach the template whole: a turn keeps its reasoning (`reasoning_content`,
`reasoning` or `thinking`, kept as `reasoning_content`), `tool_calls`, `tool_call_id` and `name`. At
render time the reasoning goes under the name the template reads (Qwen3 `reasoning_content`, gpt-oss
`thinking`), or into the content between think tags for templates that read neither (DeepSeek-R1).
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.data import images

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "chatgpt": "assistant", "bing": "assistant", "model": "assistant",
                "system": "system", "tool": "tool"}


class DataError(ValueError):
    """Input data that cannot be used, naming the file and line."""


@dataclass
class SkipCounter:
    """Why conversations were dropped, by reason, so counts always add up to the input."""
    reasons: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def skip(self, reason: str, where: str) -> None:
        self.reasons[reason] += 1
        self.examples.setdefault(reason, where)


FORMAT_KEYS = {"sharegpt": "conversations", "openai": "messages", "text": "text", "prompt": "prompt", "alpaca": "instruction"}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")   # what datasets and servers call it
KEPT_KEYS = ("tool_calls", "tool_call_id", "name")                # what templates read besides role and content


def normalize(record: dict, where: str, fmt: str = "auto", base_dir: Path | None = None) -> dict:
    """One record in any supported form -> {"id", "messages"} or {"id", "text"}. Images (content parts, LLaVA's
    `<image>` markers) become OpenAI image parts, relative paths read from `base_dir` (data/images.py)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if fmt != "auto" and FORMAT_KEYS[fmt] not in record:
        raise DataError(f"{where}: format {fmt!r} expects a {FORMAT_KEYS[fmt]!r} key (found {sorted(record)})")
    rid = str(record.get("id", where))
    domain = {"domain": record["domain"]} if isinstance(record.get("domain"), str) else {}
    try:
        item = _turns_of(record, where, rid, base_dir)
        if "messages" in item and (record.get("image") or record.get("images")):
            item["messages"] = images.llava_turns(record, item["messages"], where, base_dir)
    except images.ImageError as exc:
        raise DataError(str(exc)) from None
    return item | domain


def _turns_of(record: dict, where: str, rid: str, base_dir: Path | None = None) -> dict:
    if "text" in record and isinstance(record["text"], str) and "messages" not in record:
        return {"id": rid, "text": record["text"]}
    if "messages" not in record and "conversations" not in record and ("prompt" in record or "instruction" in record):
        return {"id": rid, "messages": _prompt_turns(record, where)}
    if "messages" in record:
        turns, role_key, content_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns = record["conversations"]
        first = turns[0] if turns else {}
        role_key, content_key = ("from", "value") if "from" in first else ("role", "content")
    else:
        raise DataError(f"{where}: no 'messages', 'conversations', 'prompt', 'instruction' or 'text' key (found {sorted(record)})")
    return {"id": rid, "messages": [_turn(turn, i, where, role_key, content_key, base_dir) for i, turn in enumerate(turns)]}


def _prompt_turns(record: dict, where: str) -> list[dict]:
    """A prompt record: {"prompt"} (one user turn, an optional "system"), or Alpaca's {"instruction",
    "input", "output"} (instruction and input as one user turn; the output, if any, as the answer)."""
    key = "prompt" if "prompt" in record else "instruction"
    if not isinstance(record[key], str) or not record[key].strip():
        raise DataError(f"{where}: {key!r} must be a non-empty string")
    extra = record.get("input") if key == "instruction" else None
    if extra is not None and not isinstance(extra, str):
        raise DataError(f"{where}: 'input' must be a string")
    system = record.get("system")
    turns = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
    turns.append({"role": "user", "content": record[key] + (f"\n\n{extra}" if extra else "")})
    answer = record.get("output") if key == "instruction" else None
    if isinstance(answer, str) and answer.strip():
        turns.append({"role": "assistant", "content": answer})
    return turns


def to_answer(messages: list[dict]) -> list[dict]:
    """The turns regeneration walks: a conversation that ends with the user's turn (a prompt) gets an empty
    assistant turn after it, for the target to answer like any other."""
    return messages + [{"role": "assistant", "content": ""}] if messages and messages[-1]["role"] == "user" else messages


def _turn(turn, i: int, where: str, role_key: str, content_key: str, base_dir: Path | None = None) -> dict:
    """One turn: role, content (a string, or text and image parts), and the fields chat templates read
    (reasoning, tool calls, ids, names)."""
    role = ROLE_ALIASES.get(str(turn.get(role_key, "")).lower()) if isinstance(turn, dict) else None
    content = turn.get(content_key) if isinstance(turn, dict) else None
    if content is None and role == "assistant" and turn.get("tool_calls"):  # role set: turn is a dict
        content = ""  # a turn that only calls tools
    if isinstance(content, list) and role is not None:
        content = images.parts_of(content, f"{where} turn {i}", base_dir)
        if not any(part["type"] == "image" for part in content):  # text parts only: one string, as templates expect
            content = images.text_of(content)
    if role is None or not isinstance(content, (str, list)):
        raise DataError(f"{where}: turn {i} needs '{role_key}' (user/assistant/system/tool) and a string '{content_key}' "
                        "(or a list of text and image parts)")
    message = {"role": role, "content": content}
    reasoning = next((turn[k] for k in REASONING_KEYS if isinstance(turn.get(k), str) and turn[k]), None)
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    message.update({k: turn[k] for k in KEPT_KEYS if turn.get(k) is not None})
    if "tool_calls" in message and not isinstance(message["tool_calls"], list):
        raise DataError(f"{where}: turn {i} 'tool_calls' must be a list of calls")
    return message


def read_records(path: str, bad_lines: str, skips: SkipCounter, source=None):
    """Yield (where, record) from a .jsonl/.json file or a `datasets` source (its split, configuration
    name and streaming from `source`, a recipe DataSource)."""
    from draftsmith.data import prompt_sets
    file = Path(path)
    if prompt_sets.is_builtin(path):
        for index, record in enumerate(prompt_sets.load(path, getattr(source, "split", "train"))):
            yield f"{path}[{index}]", record
    elif file.suffix == ".jsonl":
        if not file.exists():
            raise DataError(f"data file {path!r} does not exist")
        with open(file, "rb") as handle:
            for number, raw in enumerate(handle, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    if bad_lines == "fail":
                        raise DataError(f"{path}:{number}: invalid UTF-8 ({_bad_bytes(exc)}); fix the line or set "
                                        "data.bad_lines: skip") from None
                    skips.skip("invalid_utf8", f"{path}:{number}")
                    continue
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{number}", json.loads(line)
                except json.JSONDecodeError as exc:
                    if bad_lines == "fail":
                        raise DataError(f"{path}:{number}: malformed JSON ({exc.msg})") from None
                    skips.skip("malformed_json", f"{path}:{number}")
    elif file.suffix == ".json":
        if not file.exists():
            raise DataError(f"data file {path!r} does not exist")
        raw = file.read_bytes()
        try:
            items = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            line = raw[:exc.start].count(b"\n") + 1
            raise DataError(f"{path}:{line}: invalid UTF-8 ({_bad_bytes(exc)}); a .json file is one document and "
                            "cannot be skipped line by line: fix it or convert it to .jsonl") from None
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: malformed JSON at line {exc.lineno} ({exc.msg})") from None
        if not isinstance(items, list):
            raise DataError(f"{path}: expected a JSON list of conversations")
        for index, item in enumerate(items):
            yield f"{path}[{index}]", item
    else:
        yield from _read_hf(path, source)


def _bad_bytes(exc: UnicodeDecodeError) -> str:
    return f"byte {exc.object[exc.start:exc.start + 1].hex()} at offset {exc.start} of the line: {exc.reason}"


def _read_hf(path: str, source=None):
    import datasets
    split = getattr(source, "split", "train")
    if Path(path).is_dir() and ((Path(path) / "dataset_info.json").exists() or (Path(path) / "dataset_dict.json").exists()):
        loaded = datasets.load_from_disk(path)
    else:
        try:
            loaded = datasets.load_dataset(path, getattr(source, "name", None), split=split,
                                           streaming=bool(getattr(source, "streaming", False)))
        except Exception as exc:  # datasets raises many types; name the source either way
            raise DataError(f"data source {path!r} (split {split!r}, name {getattr(source, 'name', None)!r}): cannot "
                            f"load with datasets ({type(exc).__name__}: {exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"data source {path!r}: no split {split!r} (it has {sorted(loaded)}); set its 'split'")
        loaded = loaded[split]
    for index, item in enumerate(loaded):
        yield f"{path}[{index}]", item


def with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """What the target is shown: the recipe's system prompt first (as the data stage renders it)."""
    if system_prompt and (not messages or messages[0]["role"] != "system"):
        return [{"role": "system", "content": system_prompt}] + messages
    return messages


def cut_at_stop(text: str, stop: list[str]) -> str:
    """The answer up to the first stop string, which is not kept (as the servers return it)."""
    cuts = [text.index(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


def render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    """The one place conversations become text: the tokenizer's chat template, with the recipe's
    `data.chat_template_kwargs` (e.g. enable_thinking) that `load_tokenizer` attached."""
    extra = getattr(tokenizer, "draftsmith_template_kwargs", None) or {}
    return tokenizer.apply_chat_template(for_template(tokenizer, messages), tokenize=False,
                                         add_generation_prompt=generation_prompt, **extra)


def for_template(tokenizer, messages: list[dict]) -> list[dict]:
    """Reasoning under the key this template reads (`reasoning_content`, `thinking`), or, for a template
    that reads neither, in the content between think tags (DeepSeek-R1 and others parse it there)."""
    template = tokenizer.chat_template or ""
    if not any("reasoning_content" in m for m in messages) or "reasoning_content" in template:
        return messages
    out = []
    for m in messages:
        m = dict(m)
        reasoning = m.pop("reasoning_content", None)
        if reasoning is not None and "thinking" in template:
            m["thinking"] = reasoning
        elif reasoning is not None and "</think>" not in m["content"]:
            m["content"] = f"<think>\n{reasoning}\n</think>\n\n{m['content']}"
        out.append(m)
    return out


def assistant_spans(tokenizer, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """Character spans of each assistant turn in `text`, end-of-turn token included.

    Works for any chat template by rendering the conversation up to each assistant turn with
    and without it: the difference is exactly what the assistant "says" in that template."""
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:index], generation_prompt=True)
        upto = render(tokenizer, messages[:index + 1])
        if upto.startswith(prompt) and text.startswith(upto):
            start, end = len(prompt), len(upto.rstrip())
        else:  # templates that rewrite history (e.g. dropping old reasoning): locate what is rendered
            start, end = _locate_rewritten(message["content"], upto, text, cursor)
        spans.append((start, end))
        cursor = end
    return spans


def _locate_rewritten(content: str, upto: str, text: str, cursor: int) -> tuple[int, int]:
    """Find a history-rewritten assistant turn in `text`: its content (or the part after the
    reasoning block) plus the end-of-turn marker the template puts after a final turn."""
    tail = upto.rstrip()
    for candidate in (content, content.split("</think>")[-1].lstrip("\n"), content.strip()):
        start = text.find(candidate, cursor) if candidate else -1
        if start >= 0:
            end = start + len(candidate)
            eot = tail[tail.rfind(candidate) + len(candidate):] if candidate in tail else ""
            return start, end + len(eot) if eot and text.startswith(eot, end) else end
    raise DataError("the chat template does not reproduce the assistant content")


def encode_conversation(tokenizer, conv: dict, system_prompt: str | None) -> tuple[list[int], list[int]]:
    """Render with the tokenizer's chat template; mask = assistant tokens (+ end of turn) only: the
    reasoning, tool calls and answers the target produces, never tool results or user turns."""
    if "text" in conv:
        ids = tokenizer(conv["text"], add_special_tokens=True)["input_ids"]
        return ids, [1] * len(ids)
    messages = with_system(conv["messages"], system_prompt)
    text = render(tokenizer, messages)
    text, spans = _as_produced(tokenizer, messages, text) or (text, assistant_spans(tokenizer, messages, text))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < end and e > start for start, end in spans)) if e > s else 0
            for s, e in encoded["offset_mapping"]]
    if images.has_images(messages):  # an image-text target: each image becomes its image tokens
        return images.expand(tokenizer, text, encoded["input_ids"], mask, images.images_of(messages), conv["id"])
    return encoded["input_ids"], mask


def _as_produced(tokenizer, messages: list[dict], text: str) -> tuple[str, list[tuple[int, int]]] | None:
    """For a template that drops the final turn's reasoning too (DeepSeek-R1 strips the think block
    from every assistant turn): that turn as the target produces it after its generation prompt,
    the reasoning between think tags, then the answer and the template's end of turn. None when the
    template renders the reasoning itself."""
    last = messages[-1]
    reasoning = last.get("reasoning_content") if last["role"] == "assistant" else None
    if not reasoning or reasoning in text:
        return None
    prompt = render(tokenizer, messages[:-1], generation_prompt=True)
    tail, content = text.rstrip(), last["content"]
    end_of_turn = tail[tail.rfind(content) + len(content):] if content and content in tail else ""
    opened = prompt.rstrip().endswith("<think>")
    produced = ("" if opened else "<think>\n") + f"{reasoning}\n</think>\n\n{content}{end_of_turn}"
    return prompt + produced, assistant_spans(tokenizer, messages[:-1], prompt) + [(len(prompt), len(prompt) + len(produced))]


def template_hash(tokenizer) -> str:
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()[:16]


def check_tokenizer(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: the tokenizer has no chat template; set target.chat_template in the recipe")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{where}: a fast tokenizer is needed for offset mappings (loss masks)")
