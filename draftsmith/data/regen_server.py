"""Regeneration through the inference server users already run: any OpenAI-compatible chat-completions
endpoint (`vllm serve`, `python -m sglang.launch_server`, TGI, `transformers serve`), through the
official `openai` client (its retries with exponential backoff on connection errors, timeouts, 429 and
5xx carry a job over a server restart). Before the first request the server's model is checked against
`target.model`. Conversations go out `data.regen.concurrency` at a time; each assistant turn is asked in
order with the system prompt and the regenerated history before it, as the in-process path does."""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import PurePath

from tqdm import tqdm

from draftsmith.data import images
from draftsmith.data.conversations import cut_at_stop, to_answer, with_system
from draftsmith.recipe import Recipe

PROBE_RETRIES = 2  # the first contact fails fast: a wrong URL should not wait out the job's retries


class ServerAnswerError(ValueError):
    """A server answer that cannot be used (empty, no choices); the conversation is listed as failed."""


def _client(cfg):
    from openai import OpenAI
    key = "not-needed"
    if cfg.api_key_env:
        key = os.environ.get(cfg.api_key_env)
        if not key:
            raise ValueError(f"data.regen.api_key_env={cfg.api_key_env!r}: that environment variable is not set "
                             "(it names the variable holding the server's API key; the key itself never goes in a recipe)")
    return OpenAI(base_url=cfg.server, api_key=key, timeout=cfg.timeout_s, max_retries=cfg.max_retries)


def _names(entry) -> set[str]:
    """What a listed model can be called: its id, vLLM's `root` (the path it was started from), and the
    last path component of each (a hub id or a directory named the same)."""
    names = {entry.id} | ({entry.root} if isinstance(getattr(entry, "root", None), str) else set())
    return names | {PurePath(n.rstrip("/")).name for n in names}


def served_model(client, cfg, target: str) -> str:
    """The model id to ask for: `data.regen.served_model`, or the listed model that names `target.model`.
    Refuses an unreachable server, a non-OpenAI answer and a model other than the target, naming both."""
    import openai
    probe = client.with_options(max_retries=PROBE_RETRIES, timeout=min(cfg.timeout_s, 30.0))
    where = f"data.regen.server={cfg.server!r}"
    try:
        listed = list(probe.models.list())
    except (openai.APIConnectionError, openai.APITimeoutError) as exc:
        raise ValueError(f"{where}: no server answers there ({type(exc).__name__}: {exc}); start one (vllm serve, "
                         "sglang.launch_server, transformers serve) or fix the URL") from None
    except openai.APIStatusError as exc:
        raise ValueError(f"{where}: GET /models answered HTTP {exc.status_code}; expected an OpenAI-compatible base "
                         "URL ending in /v1 (and data.regen.api_key_env if it needs a key)") from None
    except Exception as exc:  # noqa: BLE001 (a page that is not JSON, JSON that is not a model list)
        raise ValueError(f"{where}: the answer to GET /models is not an OpenAI model list ({type(exc).__name__}: "
                         f"{str(exc)[:200]}); expected an OpenAI-compatible base URL ending in /v1") from None
    ids = [getattr(m, "id", None) for m in listed]
    if not all(isinstance(i, str) for i in ids):
        raise ValueError(f"{where}: the answer to GET /models is not an OpenAI model list (entries without an id)")
    if cfg.served_model is not None:
        chosen = [m for m in listed if m.id == cfg.served_model]
        if not chosen:
            raise ValueError(f"data.regen.served_model={cfg.served_model!r} is not served by {cfg.server}; it serves {ids}")
    else:
        chosen = [m for m in listed if target in _names(m) or PurePath(target.rstrip("/")).name in _names(m)]
        if not chosen:
            raise ValueError(f"{where} serves {ids}, none of which is target.model={target!r}: regenerating with another "
                             "model trains the head on that model's distribution (set data.regen.served_model if the "
                             "server names the target differently)")
        return chosen[0].id
    entry = chosen[0]
    if target not in _names(entry) and PurePath(target.rstrip("/")).name not in _names(entry) and getattr(entry, "root", None):
        raise ValueError(f"data.regen.served_model={entry.id!r} is {entry.root!r} on the server, not "
                         f"target.model={target!r}: the regenerated answers would be another model's")
    return entry.id


def regenerate_conversation(client, model: str, conv: dict, cfg, system_prompt: str | None,
                            template_kwargs: dict) -> tuple[dict, dict, int]:
    """(the conversation with every assistant turn answered by the server, finish reasons, completion tokens)."""
    new, reasons, tokens = [], {}, 0
    extra = {"extra_body": {"chat_template_kwargs": template_kwargs}} if template_kwargs else {}
    for index, message in enumerate(to_answer(conv["messages"])):
        if message["role"] != "assistant" or message.get("tool_calls"):  # tool results answer the calls as given
            new.append(message)
            continue
        reply = client.chat.completions.create(
            model=model, messages=with_system(images.for_server(new, conv["id"]), system_prompt), max_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature, top_p=cfg.top_p, **({"stop": cfg.stop} if cfg.stop else {}), **extra)
        if not getattr(reply, "choices", None):
            raise ServerAnswerError(f"data.regen.server={cfg.server!r} answered turn {index} without choices: {str(reply)[:200]}")
        choice = reply.choices[0]
        text = cut_at_stop(choice.message.content or "", cfg.stop).strip()
        if not text:
            raise ServerAnswerError(f"data.regen.server={cfg.server!r} returned an empty completion for turn {index} "
                                    f"(finish_reason {choice.finish_reason!r})")
        new.append(_answer_turn(text, choice.message))
        reasons[choice.finish_reason or "unknown"] = reasons.get(choice.finish_reason or "unknown", 0) + 1
        tokens += getattr(reply.usage, "completion_tokens", 0) or 0
    return {"id": conv["id"], "messages": new}, reasons, tokens


def _answer_turn(text: str, message) -> dict:
    """The regenerated turn, with the reasoning the server's reasoning parser returned apart from the content
    (`reasoning_content` in vLLM and SGLang, `reasoning` in newer vLLM)."""
    extra = getattr(message, "model_extra", None) or {}
    reasoning = next((value for value in (getattr(message, "reasoning_content", None), extra.get("reasoning_content"),
                                          extra.get("reasoning")) if isinstance(value, str) and value.strip()), None)
    return {"role": "assistant", "content": text, **({"reasoning_content": reasoning.strip()} if reasoning else {})}


def regenerate_through_server(recipe: Recipe, todo: list[dict], write, counts: dict) -> None:
    """Every conversation of `todo` through the server, `concurrency` in flight; each finished one is
    handed to `write` as it arrives, each that fails after the client's retries goes to counts['failures']."""
    import openai
    cfg = recipe.data.regen
    client = _client(cfg)
    model = served_model(client, cfg, recipe.target.model)
    print(f"[draftsmith] regen: {len(todo)} conversations through {cfg.server} (model {model!r}, "
          f"{cfg.concurrency} in flight)", flush=True)
    template_kwargs = dict(recipe.data.chat_template_kwargs or {})
    started, tokens = time.perf_counter(), 0
    bar = tqdm(total=len(todo), desc="regen (server)", unit="conv", mininterval=2.0)
    with ThreadPoolExecutor(max_workers=cfg.concurrency) as pool:
        futures = {pool.submit(regenerate_conversation, client, model, conv, cfg, recipe.data.system_prompt,
                               template_kwargs): conv for conv in todo}
        for future in as_completed(futures):
            conv = futures[future]
            try:
                record, reasons, used = future.result()
            except (openai.OpenAIError, ServerAnswerError) as exc:
                counts["failures"].append({"id": conv["id"], "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                counts["finish_reasons"]["error"] += 1
            else:
                write(record)
                counts["finish_reasons"].update(reasons)
                tokens += used
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - started, 1e-9):.0f}", failed=len(counts["failures"]))
    bar.close()
    counts["completion_tokens"] = tokens
