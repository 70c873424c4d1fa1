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

from draftsmith.data import images
from draftsmith.data.conversations import cut_at_stop, to_answer, with_system
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


def _answer(model, tokenizer, histories: list[list[dict]], cfg) -> list[tuple[str, str]]:
    """(answer, finish reason: stop | length) per history: the text histories in one batched generate, the histories
    with images in another, through the target's processor."""
    seeing = [i for i, h in enumerate(histories) if images.has_images(h)]
    answers = {}
    for group in (seeing, [i for i in range(len(histories)) if i not in seeing]):
        if group:
            answers.update(zip(group, _generate(model, tokenizer, [histories[i] for i in group], cfg)))
    return [answers[i] for i in range(len(histories))]


@torch.no_grad()
def _generate(model, tokenizer, histories: list[list[dict]], cfg) -> list[tuple[str, str]]:
    """One batched generate; the histories' images (if any) go through the target's processor with their text."""
    from draftsmith.data.conversations import render
    prompts = [render(tokenizer, h, generation_prompt=True) for h in histories]
    tokenizer.padding_side = "left"
    if any(images.has_images(h) for h in histories):  # every history has them: each its own list (processors batch so)
        processor = images.processor_of(tokenizer, "data.regen")
        processor.tokenizer.padding_side = "left"
        pictures = [[images.load_image(s, "data.regen") for s in images.images_of(h)] for h in histories]
        batch = images.on_model(processor(text=prompts, images=pictures, padding=True, add_special_tokens=False,
                                          return_tensors="pt"), model)
    else:
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
    """Walk the conversations turn by turn; each assistant turn sees the regenerated history (a prompt, whose
    last turn is the user's, gets its answer as one more assistant turn)."""
    new, reasons = [{"id": c["id"], "messages": []} for c in batch], Counter()
    batch = [{"id": c["id"], "messages": to_answer(c["messages"])} for c in batch]
    for turn in range(max(len(c["messages"]) for c in batch)):
        asking = [i for i, c in enumerate(batch) if turn < len(c["messages"]) and c["messages"][turn]["role"] == "assistant"
                  and not c["messages"][turn].get("tool_calls")]  # tool results that follow answer the calls as given
        for i, c in enumerate(batch):
            if turn < len(c["messages"]) and i not in asking:
                new[i]["messages"].append(c["messages"][turn])
        if asking:
            answers = _answer(model, tokenizer, [with_system(new[i]["messages"], system_prompt) for i in asking], cfg)
            for i, (text, reason) in zip(asking, answers):
                new[i]["messages"].append({"role": "assistant", "content": text})
                reasons[reason] += 1
    return new, reasons


def _in_process(recipe: Recipe, tokenizer, todo: list[dict], write, counts: dict, layout) -> None:
    """Batched `generate` on the target; with `target.parallel` every rank of a replica runs the same
    batches on its shard (the logits are replicated), `todo` being that replica's share."""
    from draftsmith.targets import parallel
    from draftsmith.targets.loading import load_target, pick_device
    cfg = recipe.data.regen
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


def _replica_files(out_path: Path) -> list[Path]:
    """Where the writers of replicas 1.. append (replica 0 appends to out_path itself); rank 0 folds them
    into out_path at the end, and a killed run's are read back as done."""
    return sorted(out_path.parent.glob(f"{out_path.stem}.replica*.jsonl"))


def _replica_file(out_path: Path, replica: int) -> Path:
    return out_path if replica == 0 else out_path.with_name(f"{out_path.stem}.replica{replica}.jsonl")


def _appender(path: Path, on_record):
    """(handle, write): records appended and flushed as they arrive, so a kill loses nothing finished."""
    path.touch()
    handle = open(path, "a", encoding="utf-8")
    if path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        handle.write("\n")  # close a line torn by a kill, so new records start clean

    def write(record: dict) -> None:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        on_record(record)
    return handle, write


def _fold_replicas(out_path: Path) -> None:
    """Rank 0, after every replica finished: the replicas' records appended to out_path, their files removed."""
    parts = _replica_files(out_path)
    if not parts:
        return
    records = [r for part in parts for r in _load_done(part).values()]
    handle, write = _appender(out_path, lambda record: None)
    with handle:
        for record in records:
            write(record)
    for part in parts:
        part.unlink()


def _gather_counts(counts: dict, layout):
    """Rank 0 gets every replica writer's failures and finish reasons added to its own (after all of them
    finished writing); other ranks get None."""
    import torch.distributed as dist
    if layout.world == 1:
        return counts
    mine = (counts["failures"], dict(counts["finish_reasons"])) if layout.is_writer and layout.replica else ([], {})
    every = [None] * layout.world
    dist.all_gather_object(every, mine)
    if layout.rank != 0:
        return None
    for failures, reasons in every:
        counts["failures"] += failures
        counts["finish_reasons"].update(reasons)
    return counts


def _failures_file(out_path: Path) -> Path:
    return out_path.with_name(out_path.stem + ".failed.json")


def regenerate(recipe: Recipe, tokenizer, items: list[dict], out_path: Path) -> tuple[list[dict], dict]:
    """Return (regenerated conversations, counts). Already-finished ids are read back from out_path;
    failed ones keep their original answers, are counted and listed, and are retried on the next run."""
    from draftsmith.targets import parallel
    cfg = recipe.data.regen
    layout = None if cfg.server else parallel.layout_for(recipe, "regen")
    if layout is not None and layout.world > 1:
        parallel.init_process_group()
        parallel.barrier()  # every rank reads what is done before any writer appends
    done = _load_done(out_path)
    for part in _replica_files(out_path):
        done.update(_load_done(part))
    todo = [c for c in items if "messages" in c and c["id"] not in done]
    if cfg.server and not parallel.is_first_rank():
        return items, {}
    counts = {"input": len(items), "regenerated": 0, "reused": 0, "skipped": sum(1 for c in items if "messages" not in c),
              "failed": 0, "finish_reasons": Counter(), "failures": [], "via": cfg.server or "in-process"}
    started = time.perf_counter()
    if cfg.server:
        handle, write = _appender(out_path, lambda record: done.__setitem__(record["id"], record))
        with handle:
            from draftsmith.data.regen_server import regenerate_through_server
            regenerate_through_server(recipe, todo, write, counts)
    else:  # each replica its share; the first rank of each replica writes it, the others run the same forwards
        mine = todo[layout.replica::layout.dp]
        handle, write = (_appender(_replica_file(out_path, layout.replica), lambda record: None)
                         if layout.is_writer else (None, lambda record: None))
        if todo:  # every replica loads (sharded loading is collective over the world), even with an empty share
            _in_process(recipe, tokenizer, mine, write, counts, layout)
        if handle is not None:
            handle.close()
        if _gather_counts(counts, layout) is None:
            return items, {}
        _fold_replicas(out_path)
        done = _load_done(out_path)
    counts["regenerated"] = sum(1 for c in todo if c["id"] in done)
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
