"""Shared fixtures: the micro target is built once per session (deterministic: a step budget,
not a time budget), and one micro pipeline (data -> capture -> train) serves many tests."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from draftsmith import recipe as recipe_mod

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
MICRO = ROOT / "recipes" / "demo" / "micro-eagle3.yaml"

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)


def micro_recipe(out_dir: Path, target_dir: Path, *overrides: str) -> recipe_mod.Recipe:
    """The micro recipe pointed at a session target and a per-test output directory."""
    base = [f"out_dir={out_dir}", f"target.model={target_dir}", "target.embedded.train_seconds=600",
            "target.embedded.max_steps=150"]
    return recipe_mod.load(MICRO, base + list(overrides))


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("draftsmith")


@pytest.fixture(scope="session")
def micro_target(session_dir) -> Path:
    from draftsmith.targets.embedded import build_embedded_target
    target_dir = session_dir / "targets" / "micro"
    recipe = micro_recipe(session_dir / "runs", target_dir)
    build_embedded_target(recipe, target_dir, recipe.data.heldout_fraction)
    return target_dir


@pytest.fixture(scope="session")
def micro_pipeline(session_dir, micro_target):
    """data -> capture -> train on the micro target; returns the recipe."""
    from draftsmith.data.capture import run_capture
    from draftsmith.heads.registry import capture_needs
    from draftsmith.data.prepare import run_data
    from draftsmith.train.run import run_train
    recipe = micro_recipe(session_dir / "runs", micro_target)
    run_data(recipe)
    run_capture(recipe, capture_needs(recipe.head.kind))
    run_train(recipe)
    return recipe


@pytest.fixture
def tokenizer(micro_target):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(micro_target)


def tiny_llama(vocab_size: int = 64, hidden_size: int = 32):
    """A random 6-layer Llama, pad id 0, no EOS (decodes the full length): the parallel drafters' unit tests' target."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def feature_batch(target, layer_ids: list[int], B: int = 2, T: int = 14, seed: int = 0) -> dict:
    """A training batch as the trainer hands it to a head: random ids, the target's features at `layer_ids` and its
    full-vocabulary teacher, every position valid."""
    ids = torch.randint(0, target.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    probs = torch.softmax(out.logits.float(), -1)
    return {"input_ids": ids, "position_ids": torch.arange(T).expand(B, T),
            "aux": torch.cat([out.hidden_states[k] for k in layer_ids], -1), "target_probs": probs,
            "target_valid": torch.ones(B, T, dtype=torch.bool), "target_argmax": probs.argmax(-1)}


def target_config(name: str):
    """A real target's config (tests/fixtures/target_configs.json: facts, no weights)."""
    from transformers import AutoConfig
    cfg = dict(json.loads((FIXTURES / "target_configs.json").read_text())[name])
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def template(name: str) -> str:
    return (FIXTURES / "templates" / f"{name}.jinja").read_text().strip()


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def copy_target(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def two_token_joint(model, prompt, cfg) -> dict:
    """The target's exact joint distribution of its next two tokens under sampling settings `cfg`."""
    from draftsmith.runtime.verify import processed_probs
    with torch.no_grad():
        p1 = processed_probs(model(prompt[None]).logits[0, -1], cfg)
        joint = {}
        for a in torch.nonzero(p1).flatten().tolist():
            p2 = processed_probs(model(torch.cat([prompt, torch.tensor([a])])[None]).logits[0, -1], cfg)
            joint.update({(a, b): (p1[a] * p2[b]).item() for b in torch.nonzero(p2).flatten().tolist()})
    return joint


def two_token_total_variation(model, runner, drafter, prompt, cfg, num_samples: int, seed: int) -> tuple[float, bool]:
    """Speculative sampling's first two tokens against the target's exact joint distribution of them:
    (total variation distance, whether every sampled pair has nonzero target probability)."""
    from draftsmith.runtime.generate import speculative_generate
    joint = two_token_joint(model, prompt, cfg)
    gen, counts = torch.Generator().manual_seed(seed), {}
    for _ in range(num_samples):
        out = tuple(speculative_generate(runner, drafter, prompt, 2, cfg, set(), gen).tokens)
        counts[out] = counts.get(out, 0) + 1
    tv = 0.5 * sum(abs(counts.get(k, 0) / num_samples - joint.get(k, 0.0)) for k in set(joint) | set(counts))
    return tv, set(counts) <= set(joint)
