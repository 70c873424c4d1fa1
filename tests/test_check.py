"""`draftsmith check`: a clean export passes; one seeded mismatch of each kind (template, thinking mode, layer
ids, rope, norm, draft vocabulary, dtype, target, engine keys, tau, outputs) is found, one line each, exit 1."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import copy_target, template
from draftsmith.cli import main
from draftsmith.runtime.check import SIDECAR, compare_decoding, run_check
from draftsmith.runtime.export import export_head
from draftsmith.runtime.validate import run_validate, validation_is_current
from draftsmith.train.trainer import head_dir


@pytest.fixture(scope="module")
def exports(micro_pipeline, tmp_path_factory) -> Path:
    if not validation_is_current(micro_pipeline):
        run_validate(micro_pipeline)
    out = tmp_path_factory.mktemp("check")
    for engine in ("sglang", "vllm", "speculators"):
        export_head(str(head_dir(micro_pipeline)), engine, str(out / engine))
    return out


def _seeded(exports: Path, engine: str, tmp_path: Path, config=None, sidecar=None, tensors=None) -> Path:
    """A copy of one export with its config, its record or its weights edited."""
    seeded = Path(shutil.copytree(exports / engine, tmp_path / engine))
    for name, edit in (("config.json", config), (SIDECAR, sidecar)):
        if edit:
            data = json.loads((seeded / name).read_text())
            edit(data)
            (seeded / name).write_text(json.dumps(data))
    if tensors:
        weights = load_file(str(seeded / "model.safetensors"))
        tensors(weights)
        save_file(weights, str(seeded / "model.safetensors"))
    return seeded


def _codes(result: dict) -> list[str]:
    return [f["code"] for f in result["findings"]]


def test_clean_export_passes_and_decodes_as_validated(exports, capsys):
    assert main(["check", str(exports / "vllm")]) == 0
    printed = capsys.readouterr().out
    assert "OK: no mismatch found" in printed and "chain of" in printed
    result = run_check(str(exports / "sglang"))
    assert result["findings"] == [] and result["decoding"]["num_prompts"] == 3


def test_tau_is_compared_with_the_validated_chain_or_what_its_acceptance_implies():
    chain = {"tau": 2.5, "num_rounds": 40, "tree": {"depth": 3, "top_k": 1}, "acceptance_per_depth": [0.8, 0.6, 0.5]}
    measured = {"tau": 2.4, "depth": 3, "output_sha256": []}
    assert compare_decoding(measured, chain, True) == []  # within rounding of bf16 weights
    dropped = compare_decoding({**measured, "tau": 1.6}, chain, True)
    assert [f.code for f in dropped] == ["tau"] and "36% fewer" in dropped[0].cost
    tree = {**chain, "tau": 3.4, "tree": {"depth": 3, "top_k": 4}}  # a tree validates higher than the engine's chain
    implied = 1 + 0.8 + 0.8 * 0.6 + 0.8 * 0.6 * 0.5
    assert compare_decoding({**measured, "tau": implied}, tree, True) == []
    assert "implies 2.52" in compare_decoding({**measured, "tau": 1.5}, tree, True)[0].what
    outputs = compare_decoding({**measured, "output_sha256": ["a", "b"]}, {**chain, "output_sha256": ["a", "c"],
                                                                          "max_new_tokens": 8}, True)
    assert [f.code for f in outputs] == ["outputs"] and "1/2 prompts" in outputs[0].what


def test_seeded_layer_ids_are_found_and_cost_tau(exports, tmp_path, capsys):
    """SGLang configs hold ids - 1; written as the input-to-layer ids, SGLang feeds the head the next layers."""
    def unshift(config):
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = config["draftsmith_export"]["draftsmith_layer_ids"]
    seeded = _seeded(exports, "sglang", tmp_path, config=unshift)
    assert main(["check", str(seeded)]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if "MISMATCH" in line]
    assert any("[layer_ids]" in line and "off by +1" in line and "fix:" in line and "costs:" in line for line in lines)


@pytest.mark.parametrize("engine, edit, code, words", [
    ("vllm", lambda c: c.update(rope_theta=c["rope_theta"] * 4), "rope", "rope_theta"),
    ("vllm", lambda c: c.update(rms_norm_eps=1e-2), "norm", "rms_norm_eps"),
    ("vllm", lambda c: c.update(torch_dtype="float16"), "dtype", "float16"),
    ("sglang", lambda c: c.update(architectures=["LlamaForCausalLM"]), "engine_keys", "Eagle3"),
    ("speculators", lambda c: c["speculators_config"]["verifier"].update(name_or_path="meta-llama/Llama-3.1-8B-Instruct"),
     "target", "verifier"),
])
def test_seeded_config_mismatches(exports, tmp_path, engine, edit, code, words):
    result = run_check(str(_seeded(exports, engine, tmp_path, config=edit)), lint_only=True)
    assert _codes(result) == [code], result["lines"]
    assert words in result["lines"][0]


def test_seeded_missing_vocabulary_map(exports, tmp_path):
    seeded = _seeded(exports, "vllm", tmp_path, tensors=lambda w: w.pop("d2t"))
    result = run_check(str(seeded), lint_only=True)
    assert _codes(result) == ["vocab"] and "no d2t" in result["lines"][0]
    def reverse(weights):  # a valid one-to-one map, but not the trained one
        ids = (torch.arange(len(weights["d2t"])) + weights["d2t"]).flip(0)
        weights["d2t"] = ids - torch.arange(len(ids))
    result = run_check(str(_seeded(exports, "vllm", tmp_path / "b", tensors=reverse)), lint_only=True)
    assert _codes(result) == ["vocab"] and "differs from the trained checkpoint" in result["lines"][0]


def test_seeded_system_prompt_and_thinking_mode(exports, micro_pipeline, tmp_path):
    def system(record):
        record["recipe"] = record["recipe"].replace("system_prompt: null", "system_prompt: You are terse.")
    result = run_check(str(_seeded(exports, "vllm", tmp_path, sidecar=system)), lint_only=True)
    assert _codes(result) == ["template"] and "You are terse" in result["lines"][0]
    # trained with thinking off on a template that thinks by default; served with the template's default
    served = copy_target(Path(micro_pipeline.target.model), tmp_path / "qwen3-template")
    config = json.loads((served / "tokenizer_config.json").read_text())
    config["chat_template"] = template("qwen3")
    (served / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in served.glob("chat_template.*"):
        extra.write_text(template("qwen3"))

    def thinking_off(record):
        record["recipe"] = record["recipe"].replace("chat_template_kwargs: {}", "chat_template_kwargs: {enable_thinking: false}")
    seeded = _seeded(exports, "vllm", tmp_path / "t", sidecar=thinking_off)
    result = run_check(str(seeded), target=str(served), lint_only=True)
    assert "template" in _codes(result)
    assert any("enable_thinking=False" in line for line in result["lines"])
    served_off = run_check(str(seeded), target=str(served), chat_template_kwargs={"enable_thinking": False}, lint_only=True)
    assert not any("thinking" in line for line in served_off["lines"])


def test_another_target_changes_outputs(exports, micro_pipeline, tmp_path):
    """The same architecture with other weights: the fingerprint and the greedy outputs differ from the record."""
    other = copy_target(Path(micro_pipeline.target.model), tmp_path / "other")
    weights = load_file(str(other / "model.safetensors"))
    torch.manual_seed(0)
    for name, tensor in weights.items():
        if tensor.is_floating_point() and "norm" not in name:
            weights[name] = tensor + 0.5 * torch.randn_like(tensor)
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    result = run_check(str(exports / "vllm"), target=str(other))
    codes = _codes(result)
    assert "target" in codes and "outputs" in codes


def test_export_without_a_record_needs_a_recipe(exports, micro_pipeline, tmp_path):
    bare = Path(shutil.copytree(exports / "vllm", tmp_path / "bare"))
    (bare / SIDECAR).unlink()
    with pytest.raises(ValueError, match="--recipe"):
        run_check(str(bare), lint_only=True)
    recipe_path = micro_pipeline.run_dir / "recipe.yaml"
    if not recipe_path.exists():
        from draftsmith import recipe as recipe_mod
        recipe_path.write_text(recipe_mod.dump(micro_pipeline))
    assert run_check(str(bare), recipe_path=str(recipe_path), lint_only=True)["findings"] == []
