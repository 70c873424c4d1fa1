"""Regeneration: replace every assistant turn with the target's own answer.

Training on what the target itself says is what raises acceptance: the head learns the target's
distribution, not the dataset author's. Two answerers walk the conversations the same way (each
assistant turn in order, seeing the system prompt and the regenerated history before it): in process
(batched `generate`) or an OpenAI-compatible server (`data.regen.server`, data/regen_server.py).
Resumable: finished conversations are appended to a JSONL file keyed by id and never redone;
regenerated + reused + skipped + failed always equals the input count, and every failure is listed."""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.recipe import Recipe

MAX_LISTED_FAILURES = 50  # in the manifest; the whole list goes to <regen file>.failed.json


def _load_done(path: Path) -> dict[str, dict]:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill; that conversation is redone
            done[record["id"]] = record
    return done


def with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """What the target is shown: the recipe's system prompt first (as the data stage renders it)."""
    if system_prompt and (not messages or messages[0]["role"] != "system"):
        return [{"role": "system", "content": system_prompt}] + messages
    return messages


def cut_at_stop(text: str, stop: list[str]) -> str:
    """The answer up to the first stop string, which is not kept (as the servers return it)."""
    cuts = [text.index(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


@torch.no_grad()
def _answer(model, tokenizer, histories: list[list[dict]], cfg) -> list[tuple[str, str]]:
    """(answer, finish reason: stop | length) per history, in one batched generate."""
    from draftsmith.data.conversations import render
    prompts = [render(tokenizer, h, generation_prompt=True) for h in histories]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    sample = cfg.temperature > 0
    out = model.generate(**batch, max_new_tokens=cfg.max_new_tokens, do_sample=sample,
                         temperature=cfg.temperature if sample else None, top_p=cfg.top_p if sample else None, top_k=None,
                         stop_strings=cfg.stop or None, tokenizer=tokenizer if cfg.stop else None,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    answers = []
    for row in out[:, batch["input_ids"].shape[1]:]:
        text = tokenizer.decode(row, skip_special_tokens=True)
        cut = cut_at_stop(text, cfg.stop)
        ended = len(cut) < len(text) or bool((row == (tokenizer.pad_token_id or tokenizer.eos_token_id)).any())
        answers.append((cut.strip(), "stop" if ended or len(row) < cfg.max_new_tokens else "length"))
    return answers


def _regenerate_batch(model, tokenizer, batch: list[dict], cfg, system_prompt) -> tuple[list[dict], Counter]:
    """Walk the conversations turn by turn; each assistant turn sees the regenerated history."""
    new, reasons = [{"id": c["id"], "messages": []} for c in batch], Counter()
    for turn in range(max(len(c["messages"]) for c in batch)):
        asking = [i for i, c in enumerate(batch) if turn < len(c["messages"]) and c["messages"][turn]["role"] == "assistant"]
        for i, c in enumerate(batch):
            if turn < len(c["messages"]) and i not in asking:
                new[i]["messages"].append(c["messages"][turn])
        if asking:
            answers = _answer(model, tokenizer, [with_system(new[i]["messages"], system_prompt) for i in asking], cfg)
            for i, (text, reason) in zip(asking, answers):
                new[i]["messages"].append({"role": "assistant", "content": text})
                reasons[reason] += 1
    return new, reasons


def _in_process(recipe: Recipe, tokenizer, todo: list[dict], write, counts: dict) -> None:
    """Batched `generate` on the target; with `target.parallel` every rank of the one replica runs the
    same batches on its shard (the logits are replicated) and only rank 0 writes."""
    from draftsmith.targets import parallel
    from draftsmith.targets.loading import load_target, pick_device
    cfg = recipe.data.regen
    layout = parallel.layout_for(recipe, "regen")
    parallel.one_replica(layout, "in-process regeneration")
    device = parallel.rank_device(pick_device())
    model = load_target(recipe, device, layout, "regen")
    # transformers' pipeline stages decode a left-padded row wrongly once the KV cache is in use (the
    # prefill is right, later tokens diverge from one process): under pp a batch is one conversation
    batch_size = cfg.batch_size if layout.pp == 1 else 1
    if batch_size != cfg.batch_size and layout.rank == 0:
        print(f"[draftsmith] target.parallel.pp={layout.pp}: regenerating one conversation at a time "
              f"(data.regen.batch_size={cfg.batch_size} applies at pp 1); tp batches them", flush=True)
    for start in tqdm(range(0, len(todo), batch_size), desc="regen", unit="batch", mininterval=2.0,
                      disable=layout.rank != 0):
        batch = todo[start:start + batch_size]
        try:
            results, reasons = _regenerate_batch(model, tokenizer, batch, cfg, recipe.data.system_prompt)
        except (RuntimeError, ValueError) as exc:
            counts["failures"] += [{"id": c["id"], "error": f"{type(exc).__name__}: {exc}"} for c in batch]
            continue
        counts["finish_reasons"].update(reasons)
        for record in results:
            write(record)


def _failures_file(out_path: Path) -> Path:
    return out_path.with_name(out_path.stem + ".failed.json")


def regenerate(recipe: Recipe, tokenizer, items: list[dict], out_path: Path) -> tuple[list[dict], dict]:
    """Return (regenerated conversations, counts). Already-finished ids are read back from out_path;
    failed ones keep their original answers, are counted and listed, and are retried on the next run."""
    from draftsmith.targets import parallel
    cfg = recipe.data.regen
    if not cfg.server and parallel.world_and_rank()[0] > 1:
        parallel.init_process_group()
        parallel.barrier()  # every rank reads what is done before rank 0 appends anything
    done = _load_done(out_path)
    todo = [c for c in items if "messages" in c and c["id"] not in done]
    if not parallel.is_first_rank():  # a sharded target's other ranks: the same forwards, nothing written
        if todo and not cfg.server:
            _in_process(recipe, tokenizer, todo, lambda record: None, {"finish_reasons": Counter(), "failures": []})
        return items, {}
    counts = {"input": len(items), "regenerated": 0, "reused": 0, "skipped": sum(1 for c in items if "messages" not in c),
              "failed": 0, "finish_reasons": Counter(), "failures": [], "via": cfg.server or "in-process"}
    started = time.perf_counter()
    out_path.touch()
    with open(out_path, "a", encoding="utf-8") as handle:
        if out_path.stat().st_size and not out_path.read_bytes().endswith(b"\n"):
            handle.write("\n")  # close a line torn by a kill, so new records start clean

        def write(record: dict) -> None:  # appended and flushed as it arrives: a kill loses nothing finished
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            done[record["id"]] = record
            counts["regenerated"] += 1

        if todo and cfg.server:
            from draftsmith.data.regen_server import regenerate_through_server
            regenerate_through_server(recipe, todo, write, counts)
        elif todo:
            _in_process(recipe, tokenizer, todo, write, counts)
    counts["failed"] = len(counts["failures"])
    counts["reused"] = sum(1 for c in items if "messages" in c and c["id"] in done) - counts["regenerated"]
    counts["seconds"] = round(time.perf_counter() - started, 1)
    _failures_file(out_path).write_text(json.dumps(counts["failures"], indent=1) + "\n")
    if counts["failures"]:
        print(f"[draftsmith] regen: {counts['failed']} conversation(s) failed and keep their original answers "
              f"(listed in {_failures_file(out_path)}; rerun to retry them): {counts['failures'][0]['error']}", flush=True)
    counts["failures"] = counts["failures"][:MAX_LISTED_FAILURES]
    counts["finish_reasons"] = dict(counts["finish_reasons"])
    result = [done.get(c["id"], c) for c in items]  # failed or text-only ones keep their original form
    assert counts["regenerated"] + counts["reused"] + counts["skipped"] + counts["failed"] == counts["input"]
    return result, counts
