"""Export adapters against published layouts, round trips, layer-index conventions, and the
refusal to export unvalidated heads."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from draftsmith import artifacts
from draftsmith.heads.ttt import shift_left
from draftsmith.runtime.export import export_head
from draftsmith.heads.loading import load_head
from draftsmith.runtime.validate import run_validate
from draftsmith.train.trainer import head_dir

LAYOUTS = json.loads((Path(__file__).parent / "fixtures" / "published_eagle3_layouts.json").read_text())
SGLANG_REF = LAYOUTS["eagle3__yuhuili__EAGLE3-LLaMA3.1-Instruct-8B"]
SPECULATORS_REF = LAYOUTS["speculators__nm-testing__EAGLE3-LLaMA3.1-Instruct-8B-converted"]
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64", torch.bool: "BOOL"}


@pytest.fixture(scope="module")
def validated(micro_pipeline):
    run_validate(micro_pipeline)
    return micro_pipeline


def _tensors(directory: Path) -> dict:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}


def _export(recipe, engine, tmp_path, **kw):
    return export_head(str(head_dir(recipe)), engine, str(tmp_path / engine), **kw)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_engine_layout_matches_published_heads(validated, tmp_path, engine):
    _export(validated, engine, tmp_path)
    tensors = _tensors(tmp_path / engine)
    assert set(tensors) == set(SGLANG_REF["tensors"])                     # no embedding, midlayer.* names
    for name, ref in SGLANG_REF["tensors"].items():
        assert len(tensors[name].shape) == len(ref["shape"])
        kind = "BF16" if ref["dtype"] in ("F16", "BF16") else ref["dtype"]
        assert DTYPE_NAMES[tensors[name].dtype] == kind, name               # bf16 weights, I64 d2t, BOOL t2d
    config = json.loads((tmp_path / engine / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert set(SGLANG_REF["config"]) - {"transformers_version", "use_cache", "initializer_range", "pad_token_id"} <= set(config) | {"torch_dtype"}
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    h = config["hidden_size"]
    assert list(tensors["fc.weight"].shape) == [h, 3 * config["target_hidden_size"]]
    assert list(tensors["midlayer.self_attn.q_proj.weight"].shape) == [config["num_attention_heads"] * config["head_dim"], 2 * h]
    assert list(tensors["lm_head.weight"].shape) == [config["draft_vocab_size"], h]
    assert list(tensors["t2d"].shape) == [config["vocab_size"]] and int(tensors["t2d"].sum()) == config["draft_vocab_size"]
    # the position range it was trained for travels with it; RoPE is the target's (served at the target's context)
    assert config["draftsmith_export"]["trained_max_tokens"] == min(validated.data.max_length, validated.train.max_batch_tokens)
    assert "trained on samples of up to" in (tmp_path / engine / "README.md").read_text()


def test_speculators_layout_matches_published_heads(validated, tmp_path):
    _export(validated, "speculators", tmp_path)
    tensors = _tensors(tmp_path / "speculators")
    assert set(tensors) == set(SPECULATORS_REF["tensors"])                 # layers.0.*, embed_tokens stored
    config = json.loads((tmp_path / "speculators" / "config.json").read_text())
    for key in ("speculators_model_type", "architectures", "draft_vocab_size", "norm_before_residual",
                "speculators_config", "speculators_version", "target_hidden_size", "transformer_layer_config"):
        assert key in config, key
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["norm_before_residual"] is False      # vLLM's bridge would default it to True
    proposal = config["speculators_config"]["proposal_methods"][0]
    assert set(proposal) == set(SPECULATORS_REF["config"]["speculators_config"]["proposal_methods"][0])
    assert config["speculators_config"]["verifier"]["name_or_path"] == validated.target.model
    assert set(SPECULATORS_REF["config"]["transformer_layer_config"]) - {"pretraining_tp", "use_cache", "initializer_range",
                                                                          "attention_dropout"} <= set(config["transformer_layer_config"])


def sglang_capture_ids(config: dict) -> list[int]:
    """SGLang's loading rule, written from its documented behaviour: config ids + 1 are the layers
    whose input is captured (set_eagle3_layers_to_capture)."""
    return [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]


def vllm_capture_ids(config: dict) -> list[int]:
    """vLLM's rule: ids (eagle_config or top level, or speculators top level) are input-to-layer, verbatim."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    return list(ids)


def test_layer_index_conventions(validated, tmp_path):
    for engine in ("sglang", "vllm", "speculators"):
        _export(validated, engine, tmp_path)
    trained = artifacts.load_checkpoint(head_dir(validated))[1]["layer_ids"]
    sg = json.loads((tmp_path / "sglang" / "config.json").read_text())
    vl = json.loads((tmp_path / "vllm" / "config.json").read_text())
    sp = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [k - 1 for k in trained]
    assert sglang_capture_ids(sg) == vllm_capture_ids(vl) == vllm_capture_ids(sp) == trained


@pytest.mark.parametrize("engine", ["sglang", "vllm", "speculators"])
def test_round_trip_gives_identical_logits(validated, tmp_path, engine):
    _export(validated, engine, tmp_path, dtype="fp32")
    target_config = AutoConfig.from_pretrained(validated.target.model)
    ours, _ = load_head(head_dir(validated), target_config)
    back, meta = load_head(tmp_path / engine, target_config)
    back.load_target_weights(ours.embed_tokens.weight)
    assert back.config["draftsmith"]["layer_ids"] == ours.config["draftsmith"]["layer_ids"]
    torch.manual_seed(0)
    ids, aux = torch.randint(0, 500, (1, 12)), torch.randn(1, 12, ours.fc.in_features)
    pos = torch.arange(12)[None]

    def run(head):
        sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        return head.logits(head.step(shift_left(ids, 1), head.fc(aux), pos, sdpa))

    torch.testing.assert_close(run(back), run(ours), rtol=0, atol=0)
    assert torch.equal(back.d2t, ours.d2t) and torch.equal(back.t2d, ours.t2d)


def test_bf16_export_round_trip_is_close(validated, tmp_path):
    _export(validated, "sglang", tmp_path)
    target_config = AutoConfig.from_pretrained(validated.target.model)
    ours, _ = load_head(head_dir(validated), target_config)
    back, _ = load_head(tmp_path / "sglang", target_config)
    for name, tensor in ours.trainable_state().items():
        torch.testing.assert_close(back.trainable_state()[name].float(), tensor.float(), rtol=1e-2, atol=1e-2)


def test_export_refuses_unvalidated_head(micro_pipeline, tmp_path):
    head = tmp_path / "head"
    shutil.copytree(head_dir(micro_pipeline), head)
    with pytest.raises(ValueError, match="no validation.json"):
        export_head(str(head), "sglang", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    result = export_head(str(head), "sglang", str(tmp_path / "out"), allow_unvalidated=True)
    assert result["validated"] is False
    assert "not validated" in (tmp_path / "out" / "README.md").read_text()


def test_export_refuses_a_failed_or_stale_validation(validated, tmp_path):
    head = tmp_path / "run" / "head"
    shutil.copytree(head_dir(validated), head)
    shutil.copytree(validated.run_dir / "validate", tmp_path / "run" / "validate")
    result = json.loads((tmp_path / "run" / "validate" / "validation.json").read_text())
    (tmp_path / "run" / "validate" / "validation.json").write_text(json.dumps(result | {"passed": False}))
    with pytest.raises(ValueError, match="did not pass"):
        export_head(str(head), "vllm", str(tmp_path / "out"))
    (tmp_path / "run" / "validate" / "validation.json").write_text(json.dumps(result | {"head_sha256": "0" * 64}))
    with pytest.raises(ValueError, match="other weights"):
        export_head(str(head), "vllm", str(tmp_path / "out"))


def test_model_card_has_validation_summary_and_serve_command(validated, tmp_path):
    _export(validated, "sglang", tmp_path)
    card = (tmp_path / "sglang" / "README.md").read_text()
    assert "tau" in card and "--speculative-algorithm EAGLE3" in card and validated.target.model in card


def test_validate_accepts_exported_directories(validated, tmp_path):
    _export(validated, "speculators", tmp_path)
    summary = run_validate(validated, head=str(tmp_path / "speculators"), out=str(tmp_path / "val"))
    assert summary["exact_match"] is True
    report = json.loads((tmp_path / "val" / "validation.json").read_text())
    assert report["head_format"] == "speculators"
    # the reference is the model's own generate too (its dynamic cache), prompt by prompt, and rounds by position
    assert report["exact_vs_generate"] and report["num_exact_vs_generate"] == report["num_prompts"] > 0
    assert sum(b["num_rounds"] for b in report["screen"]["per_position"].values()) == report["num_rounds"]
    assert "to the model's own `generate`" in (tmp_path / "val" / "report.md").read_text()
