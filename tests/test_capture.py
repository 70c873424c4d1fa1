"""Capture store: exact tensors, resumability after kill -9, corruption, manifests, 2 processes."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, micro_recipe
from draftsmith import artifacts
from draftsmith.data import capture
from draftsmith.data.prepare import load_train, run_data
from draftsmith.data.store import CaptureStore


def _independent_features(model_dir, input_ids, layer_ids):
    """Hidden states computed with plain transformers (output_hidden_states), no hooks of ours."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=input_ids[None], output_hidden_states=True)
    aux = torch.cat([out.hidden_states[k][0] for k in layer_ids], dim=-1)
    final = out.hidden_states[-1][0]  # HF applies the final norm to the last entry
    return aux, final


def test_store_matches_independent_hidden_states(micro_pipeline):
    recipe = micro_pipeline
    store = CaptureStore(capture.capture_dir(recipe))
    dataset, _ = load_train(recipe)
    ids = store.manifest["layer_ids"]
    for i in (0, 7, len(store) - 1):
        sample = store[i]
        assert sample["input_ids"].tolist() == dataset[i]["input_ids"]
        aux, final = _independent_features(recipe.target.model, sample["input_ids"], ids)
        keep = sample["aux"].shape[0]
        torch.testing.assert_close(sample["aux"], aux[:keep], atol=0.05, rtol=0.02)  # bf16 storage
        pos = sample["teacher_pos"]
        assert torch.equal(pos, torch.nonzero(sample["loss_mask"][1:]).flatten())
        torch.testing.assert_close(sample["teacher"], final[pos], atol=0.05, rtol=0.02)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_feature_extractor_on_other_architectures(tmp_path, arch):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(arch, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / arch)
    ids = torch.randint(0, 128, (20,))
    layer_ids = capture.default_layer_ids("eagle3", 7)
    extractor = capture.FeatureExtractor(model, layer_ids)
    aux, final = extractor(ids[None])
    ref_aux, ref_final = _independent_features(tmp_path / arch, ids, layer_ids)
    torch.testing.assert_close(aux[0], ref_aux)
    torch.testing.assert_close(final[0], ref_final)


def test_fp8_rows_keep_relative_precision():
    x = torch.randn(50, 96) * torch.logspace(-3, 3, 50)[:, None]
    q, scale = capture.quantize(x, "fp8")
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (50,)
    err = (capture.dequantize(q, scale) - x).abs().amax(-1) / x.abs().amax(-1)
    assert err.max() < 0.07  # e4m3 has a 3-bit mantissa: ~6% worst case per row, whatever the row's scale


def test_dry_run_projection_matches_written_bytes(micro_pipeline):
    recipe = micro_pipeline
    dataset, data_manifest = load_train(recipe)
    manifest = artifacts.read_manifest(capture.capture_dir(recipe), "capture")
    spec = capture.CaptureSpec(**{k: manifest[k] for k in capture.CaptureSpec.__dataclass_fields__})
    projected = capture.projected_bytes(dataset, spec)
    assert abs(projected["bytes"] - manifest["num_bytes"]) / manifest["num_bytes"] < 0.05  # headers aside
    assert projected["ratio_vs_specforge"] < 1.0


def test_flipped_byte_is_detected(micro_pipeline, tmp_path):
    import shutil
    store = tmp_path / "store"
    shutil.copytree(capture.capture_dir(micro_pipeline), store)
    assert capture.verify(store) == []
    shard = store / artifacts.read_json(store / "manifest.json")["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    problems = capture.verify(store)
    assert len(problems) == 1 and "sha256 mismatch" in problems[0]
    with pytest.raises(artifacts.ArtifactError, match="corrupt"):
        CaptureStore(store, verify=True)


def test_reader_rejects_store_of_another_target(micro_pipeline):
    with pytest.raises(artifacts.ArtifactError, match="target_fingerprint"):
        CaptureStore(capture.capture_dir(micro_pipeline), expected={"target_fingerprint": "0123456789abcdef"})
    with pytest.raises(artifacts.ArtifactError, match="layer_ids"):
        CaptureStore(capture.capture_dir(micro_pipeline), expected={"layer_ids": [1, 2, 3]})


def _capture_cmd(recipe_overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "draftsmith.cli", "capture", "--recipe", str(ROOT / "recipes/demo/micro-eagle3.yaml"),
            *recipe_overrides]


def _overrides(recipe) -> list[str]:
    return [f"out_dir={recipe.out_dir}", f"target.model={recipe.target.model}", "capture.shard_size_mb=0.05",
            "capture.batch_tokens=256"]


@pytest.mark.slow
def test_kill_9_mid_capture_then_resume(tmp_path, micro_target):
    recipe = micro_recipe(tmp_path / "runs", micro_target, "capture.shard_size_mb=0.05", "capture.batch_tokens=256")
    run_data(recipe)
    store = capture.capture_dir(recipe)
    proc = subprocess.Popen(_capture_cmd(_overrides(recipe)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(capture.read_progress(store)) < 3:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = capture.read_progress(store)
    assert 3 <= sum(len(e["samples"]) for e in partial) < len(load_train(recipe)[0])
    assert not (store / "manifest.json").exists()
    subprocess.run(_capture_cmd(_overrides(recipe)), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manifest = artifacts.read_manifest(store, "capture")
    assert capture.verify(store) == []
    reader = CaptureStore(store)
    assert len(reader) == manifest["num_samples"] == len(load_train(recipe)[0])
    fresh = CaptureStore(capture.capture_dir(_clean_capture(tmp_path, micro_target)))
    for i in range(len(reader)):
        assert torch.equal(reader[i]["aux"], fresh[i]["aux"])


def _clean_capture(tmp_path, micro_target):
    recipe = micro_recipe(tmp_path / "clean", micro_target, "capture.shard_size_mb=0.05", "capture.batch_tokens=256")
    run_data(recipe)
    capture.run_capture(recipe)
    return recipe


@pytest.mark.slow
def test_two_process_capture_merges_one_manifest(tmp_path, micro_target):
    recipe = micro_recipe(tmp_path / "runs", micro_target, "data.max_conversations=40")
    run_data(recipe)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes/launch/cpu2.yaml"),
           str(ROOT / "capture_hidden_states.py"), "--recipe", str(ROOT / "recipes/demo/micro-eagle3.yaml"),
           f"out_dir={recipe.out_dir}", f"target.model={recipe.target.model}", "data.max_conversations=40"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
    store = capture.capture_dir(recipe)
    manifest = artifacts.read_manifest(store, "capture")
    ranks = {s["file"][:10] for s in manifest["shards"]}
    assert ranks == {"shard-r000", "shard-r001"}
    assert manifest["num_samples"] == 40 and capture.verify(store) == []
    reader = CaptureStore(store)
    dataset, _ = load_train(recipe)
    assert [reader[i]["input_ids"].tolist() for i in range(40)] == dataset["input_ids"]


def test_store_of_other_spec_is_restarted(tmp_path, micro_target):
    recipe = micro_recipe(tmp_path / "runs", micro_target, "data.max_conversations=12")
    run_data(recipe)
    capture.run_capture(recipe)
    other = micro_recipe(tmp_path / "runs", micro_target, "data.max_conversations=12", "capture.dtype=fp8")
    manifest = capture.run_capture(other)
    assert manifest["dtype"] == "fp8" and manifest["num_samples"] == 12
    assert CaptureStore(capture.capture_dir(other))[0]["aux"].dtype == torch.float32
