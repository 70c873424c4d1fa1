"""`make bench`, section `regen`: regeneration conversations/s and tokens/s in process (batched `generate`)
against `transformers serve` (continuous batching, on a loopback port) at concurrency 1, 4 and 16, on the
demo target and the demo's own conversations, with the share of turns identical to the in-process ones."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"
CONCURRENCY = (1, 4, 16)


def _serve(model: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", model, "--host", HOST, "--port", str(port),
           "--device", "cpu", "--dtype", "float32", "--continuous-batching"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("transformers serve exited during start") from None
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError("transformers serve did not come up in 5 minutes")


def _turns(result: list[dict]) -> list[str]:
    return [m["content"] for c in result for m in c.get("messages", []) if m["role"] == "assistant"]


def _run(recipe, conversations: list[dict], tokenizer, scratch: Path, name: str) -> tuple[dict, list[dict]]:
    from draftsmith.data.regen import regenerate
    started = time.perf_counter()
    result, counts = regenerate(recipe, tokenizer, conversations, scratch / f"{name}.jsonl")
    seconds = time.perf_counter() - started
    tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in _turns(result))
    return {"conversations_per_s": len(conversations) / seconds, "tokens_per_s": tokens / seconds, "seconds": seconds,
            "failed": counts["failed"], "finish_reasons": counts["finish_reasons"]}, result


def bench_regen(recipe, num_conversations: int = 48) -> dict:
    """In process at the recipe's batch size, then the server at each concurrency (a warm-up request first)."""
    from draftsmith.data import conversations as conv
    from draftsmith.data.prepare import collect
    from draftsmith.targets.loading import load_tokenizer
    tokenizer = load_tokenizer(recipe)
    train, _, _ = collect(recipe, conv.SkipCounter())
    items = [c for c in train if "messages" in c][:num_conversations]
    scratch = Path(tempfile.mkdtemp(prefix="draftsmith-bench-regen-"))
    rows, reference = {}, None
    try:
        rows["in-process"], reference = _run(recipe, items, tokenizer, scratch, "in-process")
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        server = _serve(recipe.target.model, port)
        try:
            recipe.data.regen.server = f"http://{HOST}:{port}/v1"
            recipe.data.regen.concurrency = 1
            _run(recipe, items[:2], tokenizer, scratch, "warm-up")
            for concurrency in CONCURRENCY:
                recipe.data.regen.concurrency = concurrency
                row, result = _run(recipe, items, tokenizer, scratch, f"server-c{concurrency}")
                same = [a == b for a, b in zip(_turns(reference), _turns(result))]
                rows[f"server, concurrency {concurrency}"] = row | {"identical_turns": sum(same) / max(len(same), 1)}
        finally:
            server.kill()
            server.wait()
    finally:
        recipe.data.regen.server = None
        shutil.rmtree(scratch, ignore_errors=True)
    return {"num_conversations": len(items), "max_new_tokens": recipe.data.regen.max_new_tokens,
            "batch_size": recipe.data.regen.batch_size, "rows": rows}


def render_regen(r: dict) -> list[str]:
    if "regen" not in r:
        return []
    g = r["regen"]
    lines = ["## Regeneration through a server (issue #21)", "",
             f"{g['num_conversations']} demo conversations, up to {g['max_new_tokens']} new tokens per turn, greedy; "
             f"in process = batched `generate` at batch size {g['batch_size']}; server = `transformers serve "
             "--continuous-batching` on a loopback port (the same CPU), through the OpenAI client. Identical turns: "
             "share of assistant turns equal to the in-process text.", "",
             "| path | conversations/s | tokens/s | identical turns | failed |", "|---|---|---|---|---|"]
    for name, row in g["rows"].items():
        same = f"{row['identical_turns']:.2f}" if "identical_turns" in row else "(reference)"
        lines.append(f"| {name} | {row['conversations_per_s']:.2f} | {row['tokens_per_s']:.0f} | {same} | {row['failed']} |")
    return lines + ["", "On a GPU cluster the server is vLLM or SGLang on the target's own GPUs; on these 2 CPU cores "
                    "both paths share the same cores, so the figures compare overheads, not engines.", ""]
