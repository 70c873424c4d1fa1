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
from draftsmith.data import records
from draftsmith.data.store import CaptureStore
from draftsmith.heads.registry import capture_needs
from draftsmith.targets import features


def _independent_features(model_dir, input_ids, layer_ids):
    """Hidden states computed with plain transformers (output_hidden_states), no hooks of ours."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=input_ids[None], output_hidden_states=True)
    aux = torch.cat([out.hidden_states[k][0] for k in layer_ids], dim=-1) if layer_ids else None
    final = out.hidden_states[-1][0]  # HF applies the final norm to the last entry
    return aux, final


def _trainer_view(store: CaptureStore, recipe, indices: list[int]) -> dict:
    """Samples as the trainer sees them: collated, and a compact store's features rebuilt."""
    from draftsmith.targets.loading import load_target_layers
    from draftsmith.train.batches import collate
    batch = collate([store[i] for i in indices], 10**6)
    if store.manifest["recompute"]:
        ids = store.manifest["layer_ids"]
        model = load_target_layers(recipe, torch.device("cpu"), skip=range(ids[0], ids[-1]))
        batch = features.FeatureCompleter(model, ids)(batch)
    return batch


def _check_against_transformers(recipe, store: CaptureStore, atol: float, rtol: float) -> None:
    dataset, _ = load_train(recipe)
    ids = store.manifest["layer_ids"]
    indices = [0, 7, len(store) - 1]
    batch = _trainer_view(store, recipe, indices)
    for b, i in enumerate(indices):
        sample = store[i]
        assert sample["input_ids"].tolist() == dataset[i]["input_ids"]
        aux, final = _independent_features(recipe.target.model, sample["input_ids"], ids)
        keep = sample["aux"].shape[0]
        torch.testing.assert_close(batch["aux"][b, :keep], aux[:keep], atol=atol, rtol=rtol)
        pos = sample["teacher_pos"]
        assert torch.equal(pos, torch.nonzero(sample["loss_mask"][1:]).flatten())
        torch.testing.assert_close(batch["teacher"][b, pos], final[pos], atol=atol, rtol=rtol)


def test_store_matches_independent_hidden_states(micro_pipeline):
    """The default store (compact: mid + high features, bf16, compressed) as the trainer sees it."""
    store = CaptureStore(capture.capture_dir(micro_pipeline))
    m = store.manifest
    assert m["recompute"] and m["stored_layer_ids"] == m["layer_ids"][1:] and m["compression"] == "zstd"
    assert store[0]["teacher"] is None and store[0]["aux"].shape[-1] == 2 * m["hidden_size"]
    assert store.lengths() == [len(store[i]["input_ids"]) for i in range(len(store))]  # from offsets, no sample read
    _check_against_transformers(micro_pipeline, store, atol=0.05, rtol=0.02)  # bf16 storage


@pytest.mark.parametrize("layout", [["capture.recompute=true"], ["capture.recompute=false", "capture.compression=none"],
                                    ["capture.recompute=false", "capture.compression=zstd"]])
def test_each_layout_gives_the_trainer_exact_features(tmp_path, micro_target, layout):
    """fp32 stores: rebuilt features and teachers equal transformers' own to float rounding."""
    from draftsmith.data.capture import run_capture
    recipe = micro_recipe(tmp_path / "runs", micro_target, "capture.dtype=fp32", "data.max_conversations=40", *layout)
    run_data(recipe)
    run_capture(recipe, capture_needs(recipe.head.kind))
    store = CaptureStore(capture.capture_dir(recipe))
    assert (store[0]["teacher"] is None) == store.manifest["recompute"]
    _check_against_transformers(recipe, store, atol=1e-5, rtol=1e-5)
    if store.manifest["compression"] == "none":  # the dry run's projection is exact, shard headers aside
        dataset, _ = load_train(recipe)
        spec = capture.CaptureSpec(**{k: store.manifest[k] for k in capture.CaptureSpec.__dataclass_fields__})
        assert abs(capture.projected_bytes(dataset, spec)["bytes"] - store.manifest["num_bytes"]) < 0.05 * store.manifest["num_bytes"]


@pytest.mark.parametrize("kind", ["eagle2", "medusa"])
def test_heads_fed_the_final_hidden_state_store_it(tmp_path, micro_target, kind):
    """EAGLE-1/2, Medusa and MTP read the final normed hidden state (HF hidden_states[-1]) at every
    position: stored once, it is also the teacher at loss positions."""
    from draftsmith.data.capture import run_capture
    recipe = micro_recipe(tmp_path / "runs", micro_target, f"head.kind={kind}", "capture.dtype=fp32", "data.max_conversations=20")
    run_data(recipe)
    manifest = run_capture(recipe, capture_needs(recipe.head.kind))
    assert manifest["feature"] == "final" and manifest["layer_ids"] == [] and not manifest["recompute"]
    store = CaptureStore(capture.capture_dir(recipe))
    for i in (0, len(store) - 1):
        sample = store[i]
        _, final = _independent_features(recipe.target.model, sample["input_ids"], [])
        keep = records.needed_length(sample["loss_mask"].tolist())
        assert sample["teacher"] is None and sample["aux"].shape == (keep, final.shape[-1])
        torch.testing.assert_close(sample["aux"], final[:keep], atol=1e-5, rtol=1e-5)
    bad = micro_recipe(tmp_path / "runs", micro_target, f"head.kind={kind}", "capture.layer_ids=[1,2]")
    with pytest.raises(ValueError, match="layer ids apply to eagle3 only"):
        capture.layer_ids_for(bad, 6, capture_needs(kind))


def test_compact_store_needs_the_kept_layers_weights(tmp_path, micro_target):
    """A weight file without a layer the trainer must run: a clear error naming the file, the tensor and the way out."""
    import shutil
    from safetensors.torch import load_file, save_file
    from draftsmith.targets.loading import load_target_layers
    target = shutil.copytree(micro_target, tmp_path / "target")
    weights = load_file(target / "model.safetensors")
    del weights["model.layers.6.mlp.up_proj.weight"]
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    recipe = micro_recipe(tmp_path / "runs", target)
    with pytest.raises(ValueError, match=r"target: weight files lack \['model.layers.6.mlp.up_proj.weight'\].*capture.recompute: false"):
        load_target_layers(recipe, torch.device("cpu"), skip=range(2, 5))
    model = load_target_layers(recipe, torch.device("cpu"), skip=range(2, 7))  # layer 6 not needed: loads
    assert not any(p.is_meta for p in model.parameters())


def test_compression_is_lossless():
    x = torch.randn(37, 96) * 3
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
        y = x.to(dtype)
        blob = records.encode(y)
        assert blob.dtype == torch.uint8
        assert torch.equal(records.decode(blob, dtype, 96).view(torch.uint8), y.view(torch.uint8))


def test_recompute_needs_ascending_layer_ids(tmp_path, micro_target):
    recipe = micro_recipe(tmp_path / "runs", micro_target, "capture.layer_ids=[4,1,2]")
    with pytest.raises(ValueError, match=r"capture.recompute needs ascending capture.layer_ids \(got \[4, 1, 2\]\)"):
        capture.make_spec(recipe, 6, 64, {"inputs_hash": "x"}, capture_needs("eagle3"))
    recipe = micro_recipe(tmp_path / "runs", micro_target, "capture.layer_ids=[4,1,2]", "capture.recompute=false")
    assert capture.make_spec(recipe, 6, 64, {"inputs_hash": "x"}, capture_needs("eagle3")).stored_layer_ids == [4, 1, 2]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_feature_extractor_on_other_architectures(tmp_path, arch):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(arch, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / arch)
    ids = torch.randint(0, 128, (20,))
    layer_ids = capture_needs("eagle3").default_layer_ids(7)
    extractor = features.FeatureExtractor(model, layer_ids)
    aux, final = extractor(ids[None])
    ref_aux, ref_final = _independent_features(tmp_path / arch, ids, layer_ids)
    torch.testing.assert_close(aux[0], ref_aux)
    torch.testing.assert_close(final[0], ref_final)


def test_fp8_rows_keep_relative_precision():
    x = torch.randn(50, 96) * torch.logspace(-3, 3, 50)[:, None]
    q, scale = records.quantize(x, "fp8")
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (50,)
    err = (records.dequantize(q, scale) - x).abs().amax(-1) / x.abs().amax(-1)
    assert err.max() < 0.07  # e4m3 has a 3-bit mantissa: ~6% worst case per row, whatever the row's scale


def test_dry_run_projection_matches_written_bytes(micro_pipeline):
    recipe = micro_pipeline
    dataset, data_manifest = load_train(recipe)
    manifest = artifacts.read_manifest(capture.capture_dir(recipe), "capture")
    spec = capture.CaptureSpec(**{k: manifest[k] for k in capture.CaptureSpec.__dataclass_fields__})
    projected = capture.projected_bytes(dataset, spec)  # no compression ratio given: the raw size
    dry = capture.run_capture(recipe, capture_needs(recipe.head.kind), dry_run=True)  # compression measured on a sample of the data
    assert abs(dry["bytes"] - manifest["num_bytes"]) / manifest["num_bytes"] < 0.05  # headers aside
    assert dry["bytes"] < projected["bytes"] and 0 < dry["compression_ratio"] < 1
    assert manifest["bytes_per_token"] / manifest["specforge_bytes_per_token"] < 0.5  # issue #3's goal, bf16


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
@pytest.mark.long
def test_kill_9_mid_capture_then_resume(tmp_path, micro_target):
    """Killed three times at different points, then finished: every sample once, valid checksums, and
    every stored tensor bit-identical to an uninterrupted capture's (batches are planned once)."""
    recipe = micro_recipe(tmp_path / "runs", micro_target, "capture.shard_size_mb=0.05", "capture.batch_tokens=256")
    run_data(recipe)
    store = capture.capture_dir(recipe)
    for shards_before_kill in (3, 7, 12):
        proc = subprocess.Popen(_capture_cmd(_overrides(recipe)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline and len(capture.read_progress(store)) < shards_before_kill and proc.poll() is None:
            time.sleep(0.02)
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
        ours, theirs = reader[i], fresh[i]
        for key, value in ours.items():
            assert (value is None and theirs[key] is None) or torch.equal(value, theirs[key]), (i, key)


def test_batch_plan_is_a_pure_function_of_lengths_and_budget():
    lengths = [5, 9, 3, 9, 1, 7, 7, 2]
    plan = capture.plan_batches(lengths, 20)
    assert sorted(i for b in plan for i in b) == list(range(8))
    assert all(max(lengths[i] for i in b) * len(b) <= 20 for b in plan)
    assert capture.plan_batches(list(lengths), 20) == plan   # nothing else goes in: resume and world size cannot change it


def _clean_capture(tmp_path, micro_target):
    recipe = micro_recipe(tmp_path / "clean", micro_target, "capture.shard_size_mb=0.05", "capture.batch_tokens=256")
    run_data(recipe)
    capture.run_capture(recipe, capture_needs(recipe.head.kind))
    return recipe


@pytest.mark.slow
@pytest.mark.long
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
    capture.run_capture(recipe, capture_needs(recipe.head.kind))
    other = micro_recipe(tmp_path / "runs", micro_target, "data.max_conversations=12", "capture.dtype=fp8")
    manifest = capture.run_capture(other, capture_needs(other.head.kind))
    assert manifest["dtype"] == "fp8" and manifest["num_samples"] == 12
    assert CaptureStore(capture.capture_dir(other))[0]["aux"].dtype == torch.float32
