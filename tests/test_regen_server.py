"""Regeneration through an OpenAI-compatible server: `transformers serve` (transformers' own server) on a
loopback port with a tiny target, against the in-process path; the server killed and restarted mid-run;
the client killed and resumed; and the bad inputs (unreachable URL, wrong model, non-JSON answers, empty
completions), the last two from a stub server on loopback. Every request goes to 127.0.0.1."""
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from conftest import micro_recipe
from draftsmith.data.regen import regenerate
from draftsmith.targets.loading import load_tokenizer

pytestmark = pytest.mark.slow
HOST = "127.0.0.1"
NEW_TOKENS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def random_target(micro_target, tmp_path_factory):
    """The micro target's tokenizer and shape with random weights: its greedy answers are never empty."""
    import shutil
    from transformers import AutoConfig, AutoModelForCausalLM
    path = tmp_path_factory.mktemp("served") / "random-target"
    config = AutoConfig.from_pretrained(micro_target)
    config.eos_token_id = None   # answers run to max_tokens: every turn has text to compare
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for file in Path(micro_target).iterdir():
        if file.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy2(file, path / file.name)
    return path


class Served:
    """`transformers serve TARGET` as a subprocess on a loopback port; start, kill -9, restart."""

    def __init__(self, model: Path):
        self.model, self.port, self.proc = model, _free_port(), None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def start(self, wait_s: float = 120) -> None:
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(self.model), "--host", HOST,
               "--port", str(self.port), "--device", "cpu", "--dtype", "float32"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + wait_s
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=2)
                return
            except OSError:
                assert self.proc.poll() is None, "transformers serve exited during start"
                time.sleep(0.5)
        raise TimeoutError("transformers serve did not come up")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def server(random_target):
    served = Served(random_target)
    served.start()
    yield served
    served.kill()


def _convs(n: int) -> list[dict]:
    return [{"id": f"c{i}", "messages": [{"role": "user", "content": f"def function_{i}(x):\n    \"\"\"Return x."},
                                         {"role": "assistant", "content": "original"},
                                         {"role": "user", "content": "Now shorter?"},
                                         {"role": "assistant", "content": "second original"}]} for i in range(n)]


def _recipe(tmp_path, target, *overrides):
    return micro_recipe(tmp_path, target, f"data.regen.max_new_tokens={NEW_TOKENS}", "data.regen.batch_size=1",
                        "data.system_prompt=You write Python.", *overrides)


def _ids_in(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def in_process(random_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inproc")
    recipe = _recipe(tmp, random_target)
    result, counts = regenerate(recipe, load_tokenizer(recipe), _convs(8), tmp / "regen.jsonl")
    assert counts["regenerated"] == 8 and counts["finish_reasons"] == {"length": 16}
    return result


def test_server_regenerates_what_the_in_process_path_does(server, random_target, in_process, tmp_path):
    recipe = _recipe(tmp_path, random_target, f"data.regen.server={server.url}", "data.regen.concurrency=4")
    result, counts = regenerate(recipe, load_tokenizer(recipe), _convs(8), tmp_path / "regen.jsonl")
    assert counts["regenerated"] == 8 and counts["failed"] == 0 and counts["finish_reasons"] == {"length": 16}
    assert counts["completion_tokens"] == 16 * NEW_TOKENS
    turns = [(a["content"], b["content"]) for x, y in zip(in_process, result) for a, b in zip(x["messages"], y["messages"])
             if a["role"] == "assistant"]
    identical = sum(a == b for a, b in turns) / len(turns)
    assert identical == 1.0, turns              # same weights, fp32, greedy, one request at a time on both sides
    assert all(t[0] not in ("original", "second original") for t in turns)


def test_a_server_restart_mid_run_loses_nothing_and_repeats_nothing(server, random_target, in_process, tmp_path):
    out, total = tmp_path / "regen.jsonl", 24
    recipe = _recipe(tmp_path, random_target, f"data.regen.server={server.url}", "data.regen.concurrency=2",
                     "data.regen.max_retries=10")
    done = {}
    job = threading.Thread(target=lambda: done.update(zip(("result", "counts"),
                                                           regenerate(recipe, load_tokenizer(recipe), _convs(total), out))))
    job.start()
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or len(_ids_in(out)) < 2):
        time.sleep(0.02)
    server.kill()                       # connection refused / reset while requests are in flight
    at_kill = len(_ids_in(out))
    time.sleep(2)
    server.start()
    job.join(timeout=300)
    assert not job.is_alive() and 2 <= at_kill < total, at_kill
    assert done["counts"]["failed"] == 0 and done["counts"]["regenerated"] == total
    assert sorted(_ids_in(out)) == sorted(f"c{i}" for i in range(total))      # each once
    assert done["result"][:8] == in_process


def test_a_killed_client_resumes_without_repeating_a_conversation(server, random_target, in_process, tmp_path):
    out = tmp_path / "regen.jsonl"
    overrides = [f"data.regen.server={server.url}", "data.regen.concurrency=1", "data.regen.max_new_tokens=64"]
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              "from pathlib import Path\nfrom conftest import micro_recipe\nfrom draftsmith.data.regen import regenerate\n"
              "from draftsmith.targets.loading import load_tokenizer\nfrom test_regen_server import _convs, _recipe\n"
              f"r = _recipe(Path({str(tmp_path)!r}), Path({str(random_target)!r}), *{overrides!r})\n"
              f"regenerate(r, load_tokenizer(r), _convs(8), Path({str(out)!r}))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parent.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or len(_ids_in(out)) < 2) and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = len(_ids_in(out))
    assert 2 <= before < 8, before
    recipe = _recipe(tmp_path, random_target, *overrides)
    _, counts = regenerate(recipe, load_tokenizer(recipe), _convs(8), out)
    assert counts["reused"] == before and counts["regenerated"] == 8 - before and counts["failed"] == 0
    assert sorted(_ids_in(out)) == sorted(f"c{i}" for i in range(8))


class _Stub(BaseHTTPRequestHandler):
    """A loopback server that answers the way a broken endpoint does (mode set per test)."""
    mode = "html"

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: str, kind: str = "application/json"):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.mode == "html":
            return self._send(200, "<html><body>It works!</body></html>", "text/html")
        self._send(200, json.dumps({"object": "list", "data": [{"id": self.server.model_id, "object": "model"}]}))

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.server.requests.append(request)
        message = {"role": "assistant", "content": ""}
        if self.mode == "reasoning":  # a server with a reasoning parser (vLLM, SGLang): reasoning apart from content
            message = {"role": "assistant", "content": f"Answer {len(self.server.requests)}.", "reasoning_content": "Thought."}
        self._send(200, json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": self.server.model_id,
                                    "choices": [{"index": 0, "finish_reason": "stop", "message": message}]}))


@pytest.fixture
def stub(random_target):
    httpd = ThreadingHTTPServer((HOST, 0), _Stub)
    httpd.model_id, httpd.requests = str(random_target), []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()


def test_bad_servers_and_settings_are_named(server, random_target, stub, tmp_path, micro_target):
    tokenizer = load_tokenizer(_recipe(tmp_path, random_target))

    def run(target, *overrides):
        return regenerate(_recipe(tmp_path, target, "data.regen.max_retries=0", *overrides), tokenizer, _convs(2),
                          tmp_path / f"regen-{time.time_ns()}.jsonl")
    with pytest.raises(ValueError, match=r"data.regen.server='http://127.0.0.1:\d+/v1': no server answers there"):
        run(random_target, f"data.regen.server=http://{HOST}:{_free_port()}/v1")
    with pytest.raises(ValueError, match=r"data.regen.served_model='no-such-model' is not served by .* it serves \["):
        run(random_target, f"data.regen.server={server.url}", "data.regen.served_model=no-such-model")
    with pytest.raises(ValueError, match=r"none of which is target.model=.*micro"):
        run(micro_target, f"data.regen.server={server.url}")
    with pytest.raises(ValueError, match=r"data.regen.api_key_env='DRAFTSMITH_NO_SUCH_KEY': that environment variable is not set"):
        run(random_target, f"data.regen.server={server.url}", "data.regen.api_key_env=DRAFTSMITH_NO_SUCH_KEY")
    url = f"http://{HOST}:{stub.server_address[1]}/v1"
    _Stub.mode = "html"
    with pytest.raises(ValueError, match=r"data.regen.server=.*not an OpenAI model list"):
        run(random_target, f"data.regen.server={url}")
    _Stub.mode = "empty"
    result, counts = run(random_target, f"data.regen.server={url}")
    assert counts["failed"] == 2 and counts["regenerated"] == 0 and counts["finish_reasons"] == {"error": 2}
    assert all("returned an empty completion for turn 1" in f["error"] for f in counts["failures"])
    assert result == _convs(2)                   # failed conversations keep their original answers, listed


def test_server_reasoning_is_kept_and_tool_call_turns_are_not_regenerated(random_target, stub, tmp_path):
    _Stub.mode = "reasoning"
    url = f"http://{HOST}:{stub.server_address[1]}/v1"
    recipe = _recipe(tmp_path, random_target, f"data.regen.server={url}", "data.regen.max_retries=0")
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "c1",
                                                                "function": {"name": "weather", "arguments": "{}"}}]}
    conv = {"id": "agent", "messages": [{"role": "user", "content": "Weather?"}, call,
                                        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "weather"},
                                        {"role": "assistant", "content": "old answer"}]}
    result, counts = regenerate(recipe, load_tokenizer(recipe), [conv], tmp_path / "regen.jsonl")
    assert counts["regenerated"] == 1 and len(stub.requests) == 1      # the tool call was not asked again
    messages = result[0]["messages"]
    assert messages[:3] == conv["messages"][:3]
    assert messages[3] == {"role": "assistant", "content": "Answer 1.", "reasoning_content": "Thought."}
    sent = stub.requests[0]["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool"]
    assert sent[2]["tool_calls"][0]["function"]["name"] == "weather" and sent[3]["tool_call_id"] == "c1"


def test_images_travel_to_the_server_as_data_urls(random_target, stub, tmp_path):
    """An image part goes to the server as OpenAI's `image_url` with a data URL (what vLLM, SGLang and transformers
    serve read without access to the data's files); the stored conversation keeps its image part."""
    from PIL import Image
    Image.new("RGB", (8, 6), "red").save(tmp_path / "red.png")
    _Stub.mode = "reasoning"
    url = f"http://{HOST}:{stub.server_address[1]}/v1"
    recipe = _recipe(tmp_path, random_target, f"data.regen.server={url}", "data.regen.max_retries=0")
    user = [{"type": "image", "image": str(tmp_path / "red.png")}, {"type": "text", "text": "Colour?"}]
    result, counts = regenerate(recipe, load_tokenizer(recipe), [{"id": "img", "messages": [{"role": "user", "content": user}]}],
                                tmp_path / "regen.jsonl")
    assert counts["regenerated"] == 1
    sent = stub.requests[0]["messages"][-1]["content"]
    assert sent[0]["type"] == "image_url" and sent[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert base64.b64decode(sent[0]["image_url"]["url"].split(",", 1)[1]) == (tmp_path / "red.png").read_bytes()
    assert sent[1] == {"type": "text", "text": "Colour?"} and result[0]["messages"][0]["content"] == user


def test_prompts_are_answered_through_the_server_as_in_process(server, random_target, tmp_path):
    """Prompt-only conversations: one answer each, the same through `transformers serve` as in process."""
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"def g{i}(y):"}]} for i in range(3)]
    local, _ = regenerate(_recipe(tmp_path / "a", random_target), load_tokenizer(_recipe(tmp_path / "a", random_target)),
                          prompts, tmp_path / "a.jsonl")
    recipe = _recipe(tmp_path / "b", random_target, f"data.regen.server={server.url}")
    remote, counts = regenerate(recipe, load_tokenizer(recipe), prompts, tmp_path / "b.jsonl")
    assert counts["regenerated"] == 3 and counts["finish_reasons"] == {"length": 3}
    assert [[m["role"] for m in c["messages"]] for c in remote] == [["user", "assistant"]] * 3
    assert [c["messages"][1]["content"] for c in remote] == [c["messages"][1]["content"] for c in local]
