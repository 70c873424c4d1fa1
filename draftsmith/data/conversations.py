"""Conversations -> tokens + assistant-only loss mask, rendered with the target's own chat template.

Inputs: JSONL/JSON in ShareGPT (`conversations`/`from`/`value`), OpenAI (`messages`/`role`/`content`)
or preformatted (`text`) form, or anything `datasets.load_dataset`/`load_from_disk` reads.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

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


FORMAT_KEYS = {"sharegpt": "conversations", "openai": "messages", "text": "text"}


def normalize(record: dict, where: str, fmt: str = "auto") -> dict:
    """One record in any supported form -> {"id", "messages"} or {"id", "text"}."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if fmt != "auto" and FORMAT_KEYS[fmt] not in record:
        raise DataError(f"{where}: format {fmt!r} expects a {FORMAT_KEYS[fmt]!r} key (found {sorted(record)})")
    rid = str(record.get("id", where))
    if "text" in record and isinstance(record["text"], str) and "messages" not in record:
        return {"id": rid, "text": record["text"]}
    if "messages" in record:
        turns, role_key, content_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns = record["conversations"]
        first = turns[0] if turns else {}
        role_key, content_key = ("from", "value") if "from" in first else ("role", "content")
    else:
        raise DataError(f"{where}: no 'messages', 'conversations' or 'text' key (found {sorted(record)})")
    messages = []
    for i, turn in enumerate(turns):
        role = ROLE_ALIASES.get(str(turn.get(role_key, "")).lower()) if isinstance(turn, dict) else None
        content = turn.get(content_key) if isinstance(turn, dict) else None
        if role is None or not isinstance(content, str):
            raise DataError(f"{where}: turn {i} needs '{role_key}' (user/assistant/system) and a string '{content_key}'")
        messages.append({"role": role, "content": content})
    return {"id": rid, "messages": messages}


def read_records(path: str, bad_lines: str, skips: SkipCounter):
    """Yield (where, record) from a .jsonl/.json file or a `datasets` source."""
    file = Path(path)
    if file.suffix == ".jsonl":
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
        yield from _read_hf(path)


def _bad_bytes(exc: UnicodeDecodeError) -> str:
    return f"byte {exc.object[exc.start:exc.start + 1].hex()} at offset {exc.start} of the line: {exc.reason}"


def _read_hf(path: str):
    import datasets
    if Path(path).is_dir() and (Path(path) / "dataset_info.json").exists() or (Path(path) / "dataset_dict.json").exists():
        loaded = datasets.load_from_disk(path)
    else:
        try:
            loaded = datasets.load_dataset(path, split="train")
        except Exception as exc:  # datasets raises many types; name the source either way
            raise DataError(f"data source {path!r}: cannot load with datasets ({type(exc).__name__}: {exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded["train"]
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
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **extra)


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
    eot = tail[tail.rfind(content) + len(content):] if content in tail else ""
    for candidate in (content, content.split("</think>")[-1].lstrip("\n"), content.strip()):
        start = text.find(candidate, cursor) if candidate else -1
        if start >= 0:
            end = start + len(candidate)
            return start, end + len(eot) if eot and text.startswith(eot, end) else end
    raise DataError("the chat template does not reproduce the assistant content")


def encode_conversation(tokenizer, conv: dict, system_prompt: str | None) -> tuple[list[int], list[int]]:
    """Render with the tokenizer's chat template; mask = assistant tokens (+ end of turn) only."""
    if "text" in conv:
        ids = tokenizer(conv["text"], add_special_tokens=True)["input_ids"]
        return ids, [1] * len(ids)
    messages = conv["messages"]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    text = render(tokenizer, messages)
    spans = assistant_spans(tokenizer, messages, text)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < end and e > start for start, end in spans)) if e > s else 0
            for s, e in encoded["offset_mapping"]]
    return encoded["input_ids"], mask


def template_hash(tokenizer) -> str:
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()[:16]


def check_tokenizer(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: the tokenizer has no chat template; set target.chat_template in the recipe")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{where}: a fast tokenizer is needed for offset mappings (loss masks)")
