"""The whole pipeline on targets of other architectures (random tiny Qwen3, Mistral and Qwen2 with
tied embeddings), as a user pointing a recipe at a hub model would run it."""
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from conftest import micro_recipe
from draftsmith.stages import run_all

# whole pipelines on every architecture: `make test-long` runs them, CI runs every tier
pytestmark = pytest.mark.long


def _save_target(path, arch: str, tokenizer_dir, **extra):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(arch, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("arch,extra", [("qwen3", {"tie_word_embeddings": False}), ("mistral", {}),
                                        ("qwen2", {"tie_word_embeddings": True})])
def test_pipeline_on_other_architectures(tmp_path, micro_target, arch, extra):
    target = _save_target(tmp_path / arch, arch, micro_target, **extra)
    recipe = micro_recipe(tmp_path / "runs", target, "target.embedded=null", "data.max_conversations=30",
                          "train.max_steps=3", "validate.num_prompts=2", "validate.max_new_tokens=12",
                          "data.regen.enabled=true", "data.regen.max_new_tokens=8", "data.regen.batch_size=16")
    summary = run_all(recipe)
    assert "greedy exact: True" in summary
    validation = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())
    assert validation["layer_ids"] == [2, 3, 4] and validation["exact_match"]
    config = json.loads((recipe.run_dir / "export" / "sglang" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["head_dim"] == 16 and config["vocab_size"] == AutoConfig.from_pretrained(target).vocab_size
    data = json.loads((recipe.run_dir / "data" / "manifest.json").read_text())
    assert data["regeneration"]["regenerated"] == 30


# today's layouts: windows and sinks, chunks, fused MoE experts (read back by the default capture.recompute), linear
# attention and state-space layers (chains: validate.top_k 1); windows and chunks a fraction of prompt + answer
MODERN = {
    "gpt_oss": (dict(num_local_experts=2, num_experts_per_tok=1, sliding_window=8), []),
    "gemma3_text": (dict(sliding_window=8), []),
    "llama4_text": (dict(attention_chunk_size=8, intermediate_size_mlp=128, num_local_experts=2, num_experts_per_tok=1), []),
    "qwen3_next": (dict(num_experts=2, num_experts_per_tok=1, linear_num_value_heads=4, linear_num_key_heads=2,
                        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2 + ["linear_attention"]),
                   ["validate.top_k=1", "validate.num_nodes=4"]),
    "falcon_h1": (dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16), ["validate.top_k=1", "validate.num_nodes=4"]),
    "lfm2": (dict(layer_types=["conv", "full_attention", "conv", "conv", "full_attention", "conv", "full_attention"]),
             ["validate.top_k=1", "validate.num_nodes=4"]),
    "gemma2": (dict(sliding_window=8), []),
    "olmo3": (dict(sliding_window=8), []),
    "exaone4": (dict(sliding_window=8), []),
    "cohere2": (dict(sliding_window=8), []),
    "mistral": (dict(sliding_window=8), []),
    "glm4_moe": (dict(n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1), []),
    "minimax_m2": (dict(num_local_experts=2, num_experts_per_tok=1), []),
    "qwen3_moe": (dict(num_experts=2, num_experts_per_tok=1), []),
    "qwen3_5_text": (dict(linear_num_value_heads=4, linear_num_key_heads=2), ["validate.top_k=1", "validate.num_nodes=4"]),
    "nemotron_h": (dict(hybrid_override_pattern="M*M-M*M", n_routed_experts=2, num_experts_per_tok=1),
                   ["validate.top_k=1", "validate.num_nodes=4"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(MODERN))
def test_pipeline_on_modern_architectures(tmp_path, micro_target, arch):
    extra, overrides = MODERN[arch]
    target = _save_target(tmp_path / arch, arch, micro_target, **extra)
    recipe = micro_recipe(tmp_path / "runs", target, "target.embedded=null", "data.max_conversations=24",
                          "train.max_steps=2", "validate.num_prompts=2", "validate.max_new_tokens=24", *overrides)
    summary = run_all(recipe)
    validation = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())
    assert validation["exact_match"] and validation["exact_vs_generate"], summary
    assert (recipe.run_dir / "export" / "sglang" / "config.json").exists()
    if arch in ("qwen3_next", "falcon_h1"):  # economics on recurrent targets: batches of rows rolled back each on its own
        from draftsmith.runtime.sweep import run_economics
        econ = micro_recipe(tmp_path / "runs", target, "target.embedded=null", "data.max_conversations=24",
                            "train.max_steps=2", "validate.num_prompts=2", "validate.max_new_tokens=24", *overrides,
                            "economics.batch_sizes=[1,3]", "economics.num_speculative_tokens=[3]", "economics.num_prompts=3",
                            "economics.max_new_tokens=12", "economics.baselines=[ngram]")
        run_economics(econ, out=str(tmp_path / "econ"))
        data = json.loads((tmp_path / "econ" / "economics.json").read_text())
        assert data["batch_sizes"] == [1, 3] and set(data["drafters"]) == {"eagle3", "ngram"}
        for name, d in data["drafters"].items():
            assert d["exact_rows"] == d["rows"] > 0 and set(d["cells"]) == {"1", "3"}, name


# every other head kind on today's layouts: each kind on a target whose layers its drafting or features must get
# right (windows and sinks, chunks, linear attention, state-space layers)
KIND_ON_TARGET = {
    ("eagle2", "gpt_oss"): [],
    ("mtp", "qwen3_next"): [],
    ("medusa", "falcon_h1"): ["head.num_heads=3"],
    ("dflash", "gemma3_text"): ["head.block_size=4", "head.num_layers=1", "head.num_anchors=16", "validate.depth=3"],
    ("peagle", "llama4_text"): ["head.num_layers=2", "head.ttt_steps=4", "validate.depth=3"],
    ("eagle2", "lfm2"): [],
}


@pytest.mark.slow
@pytest.mark.parametrize("kind, arch", sorted(KIND_ON_TARGET))
def test_other_head_kinds_on_modern_architectures(tmp_path, micro_target, kind, arch):
    extra, overrides = MODERN[arch]
    chains = ["validate.top_k=1", "validate.num_nodes=4"] if kind in ("dflash", "peagle") else []
    target = _save_target(tmp_path / arch, arch, micro_target, **extra)
    recipe = micro_recipe(tmp_path / "runs", target, "target.embedded=null", "data.max_conversations=24",
                          "train.max_steps=2", "validate.num_prompts=2", "validate.max_new_tokens=24", f"head.kind={kind}",
                          *overrides, *chains, *KIND_ON_TARGET[kind, arch])
    summary = run_all(recipe)
    validation = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())
    assert validation["exact_match"] and validation["exact_vs_generate"], summary
    assert any((recipe.run_dir / "export").iterdir())


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next", "nemotron_h", "glm4_moe"])
def test_partial_loading_converts_the_kept_layers_only(tmp_path, micro_target, arch, monkeypatch):
    """Checkpoints whose tensors transformers converts while loading (per-expert tensors fused, Nemotron-H's
    `backbone.` names): the trainer's partial load materializes exactly the kept layers' tensors on disk
    (counted where transformers copies each one out of the file), and every tensor it keeps equals the
    whole model's."""
    from types import SimpleNamespace
    from safetensors.torch import load_file
    from transformers import core_model_loading
    from draftsmith.targets.loading import load_target_layers
    target = _save_target(tmp_path / arch, arch, micro_target, **MODERN[arch][0])
    whole = AutoModelForCausalLM.from_pretrained(target).state_dict()
    on_disk = load_file(target / "model.safetensors")
    skipped = {k for k in on_disk if any(f"layers.{i}." in k for i in range(2, 5))}
    assert any("experts." in k for k in skipped) or arch == "nemotron_h"
    read, copy = [], core_model_loading._materialize_copy

    def counted(*args, **kwargs):
        tensor = copy(*args, **kwargs)
        read.append(tensor.numel())
        return tensor
    monkeypatch.setattr(core_model_loading, "_materialize_copy", counted)
    recipe = SimpleNamespace(target=SimpleNamespace(model=str(target), dtype="fp32"))
    partial = load_target_layers(recipe, torch.device("cpu"), skip=range(2, 5)).state_dict()
    assert sum(read) == sum(v.numel() for k, v in on_disk.items() if k not in skipped)
    assert set(partial) == {k for k in whole if not any(f"layers.{i}." in k for i in range(2, 5))}
    for name, tensor in partial.items():
        assert torch.equal(tensor, whole[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_next", "falcon_h1"])
def test_online_and_joint_training_on_recurrent_targets(tmp_path, micro_target, arch):
    """Regeneration (batched, left-padded: the padding must not reach the recurrent states), online training (the
    target runs inside the trainer) and joint training (Medusa-2: LoRA on the target) on targets with linear-attention
    and state-space layers: each validates exactly against `generate`."""
    extra, overrides = MODERN[arch]
    target = _save_target(tmp_path / arch, arch, micro_target, **extra)
    common = ["target.embedded=null", "data.max_conversations=24", "validate.num_prompts=2", "validate.max_new_tokens=24",
              *overrides]
    online = micro_recipe(tmp_path / "online", target, *common, "capture.mode=online", "train.max_steps=2",
                          "data.regen.enabled=true", "data.regen.max_new_tokens=8", "data.regen.batch_size=8")
    joint = micro_recipe(tmp_path / "joint", target, *common, "capture.mode=online", "head.kind=medusa", "head.num_heads=3",
                         "head.lora={rank: 4, alpha: 8, heads_only_steps: 1}", "train.max_steps=3", "validate.depth=3")
    for recipe in (online, joint):
        summary = run_all(recipe)
        validation = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())
        assert validation["exact_match"] and validation["exact_vs_generate"], summary
    assert "drift" in json.loads((joint.run_dir / "validate" / "validation.json").read_text())
    assert json.loads((online.run_dir / "data" / "manifest.json").read_text())["regeneration"]["regenerated"] == 24
    # a batch of prompts of different lengths answers as each prompt alone: left padding leaves the states untouched
    from draftsmith.data.regen import _answer
    model, tokenizer = AutoModelForCausalLM.from_pretrained(target).eval(), AutoTokenizer.from_pretrained(target)
    histories = [[{"role": "user", "content": "def add(a, b):"}],
                 [{"role": "user", "content": "import os\nimport sys\nprint(os.getcwd(), sys.argv, sorted(os.listdir()))"}]]
    alone = [_answer(model, tokenizer, [h], online.data.regen)[0] for h in histories]
    assert _answer(model, tokenizer, histories, online.data.regen) == alone and alone[0] != alone[1]
