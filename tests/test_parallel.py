"""Targets sharded over several processes (target.parallel: transformers' DistributedConfig on a torch
DeviceMesh, gloo on CPU) against one process on the micro target, and `draftsmith plan` on the real
recipes' configs (no weights). The multi-process tests carry the `parallel` marker: `make test-parallel`
runs them (CI runs it after `make test`, which leaves them out)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, micro_recipe, target_config

from draftsmith import artifacts
from draftsmith import recipe as recipe_mod
from draftsmith.data import capture
from draftsmith.data.prepare import load_train, run_data
from draftsmith.data.store import CaptureStore
from draftsmith.heads.registry import capture_needs
from draftsmith import plan
from draftsmith.targets import parallel
from draftsmith.targets.parallel import Layout

MICRO = ROOT / "recipes" / "demo" / "micro-eagle3.yaml"
SMALL = ("data.max_conversations=40", "capture.dtype=fp32", "target.dtype=fp32")
multiprocess = [pytest.mark.slow, pytest.mark.parallel]


def _torchrun(num_processes: int, *args: str, timeout: int = 600, popen: bool = False):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_processes}", *args]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if popen:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _cli(stage: str, recipe, *extra: str, flags: tuple[str, ...] = ()) -> list[str]:
    return ["-m", "draftsmith.cli", stage, *flags, "--recipe", str(MICRO), f"out_dir={recipe.out_dir}",
            f"target.model={recipe.target.model}", *SMALL, *extra]


def _with_data_of(source, out_dir: Path, micro_target, *overrides: str):
    """A recipe in `out_dir` whose data stage is a copy of `source`'s (same inputs, same hash)."""
    recipe = micro_recipe(out_dir, micro_target, *SMALL, *overrides)
    shutil.copytree(source.run_dir / "data", recipe.run_dir / "data")
    return recipe


def _assert_same_store(ours: CaptureStore, reference: CaptureStore, rtol: float = 1e-5) -> None:
    assert len(ours) == len(reference)
    for i in range(len(reference)):
        mine, theirs = ours[i], reference[i]
        assert set(mine) == set(theirs)
        for key, value in theirs.items():
            if value is None:
                assert mine[key] is None
            elif value.is_floating_point():
                err = (mine[key].float() - value.float()).norm() / value.float().norm().clamp_min(1e-12)
                assert err < rtol, (i, key, float(err))
            else:
                assert torch.equal(mine[key], value), (i, key)


def _random_target(tmp_path_factory, micro_target, model_type: str, **config) -> Path:
    """A target of `model_type` with random weights (seed 0) and the micro target's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    path = tmp_path_factory.mktemp(model_type) / "target"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config)).save_pretrained(path)
    AutoTokenizer.from_pretrained(micro_target).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, micro_target):
    """Data (40 conversations) and its capture in one process, fp32: what every sharded run must equal."""
    recipe = micro_recipe(tmp_path_factory.mktemp("parallel") / "one", micro_target, *SMALL)
    run_data(recipe)
    capture.run_capture(recipe, capture_needs(recipe.head.kind))
    return recipe


# ------------------------------------------------------------------ layouts (one process)

def test_layout_of_replicas_and_writers():
    ranks = [Layout(tp=2, world=8, rank=r) for r in range(8)]
    assert [r.dp for r in ranks] == [4] * 8
    assert [r.replica for r in ranks] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r.is_writer for r in ranks] == [True, False] * 4
    piped = [Layout(tp=2, pp=2, world=4, rank=r) for r in range(4)]
    assert [r.is_writer for r in piped] == [True, False, False, False] and piped[0].dp == 1
    assert not Layout().sharded and Layout().distributed_config() is None
    config = Layout(tp=2, ep=2, world=4).distributed_config()
    assert (config.tp_size, config.ep_size, config.dp_replicate_size) == (2, 2, 2)


def _recipe(*overrides: str):
    return recipe_mod.load(MICRO, list(overrides))


def test_layout_refused_at_start(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"3 process\(es\) launched, not a multiple of tp \* pp = 2"):
        parallel.layout_for(_recipe("target.parallel.tp=2"), "capture")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="pp serves regeneration"):
        parallel.layout_for(_recipe("target.parallel.pp=2"), "capture")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="cannot combine pipeline stages with data-parallel replicas"):
        parallel.layout_for(_recipe("target.parallel.pp=2"), "regen")
    with pytest.raises(ValueError, match="runs one replica"):
        parallel.one_replica(parallel.layout_for(_recipe("target.parallel.tp=2"), "validate"), "validate")
    with pytest.raises(recipe_mod.RecipeError, match="ep either 1 or equal to tp"):
        _recipe("target.parallel.tp=4", "target.parallel.ep=2")


def test_layout_checked_against_the_config():
    llama = target_config("meta-llama/Llama-3.3-70B-Instruct")
    with pytest.raises(ValueError, match=r"tp=3 does not divide the target's num_attention_heads=64; choose a tp that does \(1, 2, 4, 8"):
        parallel.check_config(Layout(tp=3, world=3), llama)
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        parallel.check_config(Layout(tp=2, ep=2, world=2), llama)
    with pytest.raises(ValueError, match="does not divide the target's 128 experts"):
        parallel.check_config(Layout(tp=1, ep=3, world=3), target_config("Qwen/Qwen3-30B-A3B"))
    parallel.check_config(Layout(tp=8, world=8), llama)
    parallel.check_config(Layout(tp=4, ep=4, world=4), target_config("Qwen/Qwen3-30B-A3B"))


# ------------------------------------------------------------------ plan (config only)

def _plan(recipe_path: str, model: str, gpus: int, memory_gb: float, nodes: int = 1) -> dict:
    return plan.make_plan(recipe_mod.load(ROOT / recipe_path), target_config(model), gpus, memory_gb, nodes)


def test_plan_llama_70b_on_one_8_gpu_node():
    out = _plan("recipes/llama-3.3-70b-instruct/eagle3.yaml", "meta-llama/Llama-3.3-70B-Instruct", 8, 80)
    assert 69e9 < out["params_b"] * 1e9 < 72e9
    stages = out["stages"]
    assert all(row["fits"] for row in stages.values())
    cap = stages["capture"]
    assert cap["tp"] * cap["dp"] == 8 and cap["tp"] >= 2          # 131 GiB of bf16 weights: never on one device
    assert cap["per_device_gib"]["weights"] == pytest.approx(out["weights_gib"] / cap["tp"], rel=1e-2)
    assert cap["store_bytes_per_token"] == 2 * 8192 * 2           # compact store: mid + high features, bf16
    val = stages["validate"]
    assert val["tp"] in (4, 8) and val["dp"] == 1
    assert stages["train"]["tp"] == 1                              # offline: embedding, lm_head, 5 layers
    assert all(row["per_device_gib"]["total"] <= 80e9 * plan.HEADROOM / 2**30 for row in stages.values())


def test_plan_long_samples_grow_linearly_and_fit_with_checkpointing():
    """The head's training step at 4K-64K tokens per sample (Qwen3-8B thinking recipe): at most 2.2x per doubling,
    and the 32K recipe fits one 80 GB device only with train.activation_checkpointing."""
    recipe = recipe_mod.load(ROOT / "recipes/qwen3-8b/thinking-32k-eagle3.yaml")
    facts = plan.target_facts(target_config("Qwen/Qwen3-8B"))
    for checkpointing in (False, True):
        recipe.train.activation_checkpointing = checkpointing
        sizes = []
        for tokens in (4096, 8192, 16384, 32768, 65536):
            recipe.train.max_batch_tokens = tokens
            sizes.append(plan.head_activation_bytes(recipe, facts))
        assert all(b / a <= 2.2 for a, b in zip(sizes, sizes[1:]))
    recipe = recipe_mod.load(ROOT / "recipes/qwen3-8b/thinking-32k-eagle3.yaml")
    assert plan.make_plan(recipe, target_config("Qwen/Qwen3-8B"), 1, 80)["stages"]["train"]["fits"]
    recipe.train.activation_checkpointing = False
    assert not plan.make_plan(recipe, target_config("Qwen/Qwen3-8B"), 1, 80)["stages"]["train"]["fits"]


def test_plan_deepseek_v3_and_a_mid_size_moe():
    ds = _plan("recipes/deepseek-v3/mtp.yaml", "deepseek-ai/DeepSeek-V3", 16, 141, nodes=2)
    assert 660 < ds["params_b"] < 690 and 30 < ds["active_params_b"] < 45
    cap = ds["stages"]["capture"]
    assert cap["fits"] and cap["tp"] == 16 and cap["ep"] == 16 and cap["crosses_nodes"]
    small = _plan("recipes/deepseek-v3/mtp.yaml", "deepseek-ai/DeepSeek-V3", 16, 80, nodes=2)
    assert not small["stages"]["capture"]["fits"]                 # 1.25 TiB of bf16 weights on 1.28 TB
    moe = _plan("recipes/qwen3-30b-a3b/eagle3.yaml", "Qwen/Qwen3-30B-A3B", 8, 40)
    assert moe["stages"]["capture"]["ep"] == moe["stages"]["capture"]["tp"] > 1
    assert 29 < moe["params_b"] < 32 and 2.5 < moe["active_params_b"] < 4


@pytest.mark.parametrize("recipe_path,model,memory_gb", [
    ("recipes/gpt-oss-120b/eagle3.yaml", "openai/gpt-oss-120b", 80),
    ("recipes/llama-4-scout/eagle3.yaml", "meta-llama/Llama-4-Scout-17B-16E-Instruct", 80),
    ("recipes/qwen3-next-80b-a3b/eagle3.yaml", "Qwen/Qwen3-Next-80B-A3B-Instruct", 141),
    ("recipes/gemma-3-27b/eagle3.yaml", "google/gemma-3-27b-it", 80)])
def test_plans_of_todays_targets_fit_their_launch(recipe_path, model, memory_gb):
    """The recipes for windowed, chunked and hybrid targets fit the machines their headers name; only attention
    layers hold KV (Qwen3-Next: 12 of 48), and the recurrent target's recipe drafts chains."""
    recipe = recipe_mod.load(ROOT / recipe_path)
    out = plan.make_plan(recipe, target_config(model), 8, memory_gb)
    assert all(row["fits"] for row in out["stages"].values()), out["stages"]
    facts = plan.target_facts(target_config(model))
    assert facts.kv_layers == (12 if "qwen3-next" in recipe_path else facts.layers)
    assert (recipe.validate.top_k == 1) == ("qwen3-next" in recipe_path)
    text = (ROOT / recipe_path).read_text()
    assert f"--gpu-memory-gb {memory_gb}" in text and "PLAN" not in text


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.3-70B-Instruct", "deepseek-ai/DeepSeek-V3"])
def test_plan_weights_agree_with_accelerate(model):
    from accelerate.utils import calculate_maximum_sizes
    config = target_config(model)
    facts = plan.target_facts(config)
    total_bytes, _ = calculate_maximum_sizes(plan._empty_model(config))  # fp32 on the meta device
    assert facts.params * 4 == pytest.approx(total_bytes, rel=0.2)


@pytest.mark.parametrize("stage", ["capture", "validate", "train"])
def test_a_layout_that_cannot_fit_is_refused_before_any_weight(monkeypatch, micro_target, tmp_path, stage):
    from draftsmith import stages
    recipe = micro_recipe(tmp_path, micro_target, "target.parallel.tp=2", "capture.mode=online")
    recipe.capture.mode = "offline" if stage == "capture" else "online"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(plan, "device_memory", lambda: 2e5)   # 0.2 MB devices
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: pytest.fail("weights were read before the memory check"))
    with pytest.raises(ValueError, match=rf"{stage} at tp 2 x pp 1 \(ep 1\), dp 1: 2 process\(es\): needs .* GiB per device"):
        stages.dispatch(stage, recipe, None)


def test_plan_command(tmp_path, capsys):
    from draftsmith import cli
    config_dir = tmp_path / "llama-70b"
    config_dir.mkdir()
    target_config("meta-llama/Llama-3.3-70B-Instruct").save_pretrained(config_dir)
    assert cli.main(["plan", "--recipe", str(ROOT / "recipes/llama-3.3-70b-instruct/eagle3.yaml"), "--gpus", "16",
                     "--gpu-memory-gb", "80", "--nodes", "2", "--config", str(config_dir), f"out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "70.6B parameters" in out and "16 x 80 GB on 2 node(s)" in out
    for stage in ("regen", "capture", "train", "validate"):
        assert f"  {stage}" in out
    assert cli.main(["plan", "--recipe", str(ROOT / "recipes/llama-3.3-70b-instruct/eagle3.yaml"), "--gpus", "1",
                     "--gpu-memory-gb", "80", "--config", str(tmp_path / "missing"), f"out_dir={tmp_path}"]) == 2
    assert "cannot read the target's config" in capsys.readouterr().err


# ------------------------------------------------------------------ sharded targets (several processes)

@pytest.mark.slow
@pytest.mark.parallel
def test_tp2_capture_equals_one_process_and_trains_the_same(reference, tmp_path, micro_target):
    from draftsmith.train.run import run_train
    sharded = _with_data_of(reference, tmp_path / "tp2", micro_target)
    _torchrun(2, *_cli("capture", sharded, "target.parallel.tp=2"))
    store = capture.capture_dir(sharded)
    manifest = artifacts.read_manifest(store, "capture")
    assert {s["file"][:10] for s in manifest["shards"]} == {"shard-r000"}    # one writer for the one replica
    assert capture.verify(store) == []
    _assert_same_store(CaptureStore(store), CaptureStore(capture.capture_dir(reference)))
    losses = []
    for recipe in (reference, sharded):   # the one-process trainer reads the sharded run's store
        step = micro_recipe(recipe.out_dir, micro_target, *SMALL, "train.max_steps=1", "train.eval_every=1000")
        run_train(step)
        losses.append(json.loads((step.run_dir / "train" / "metrics.jsonl").read_text().splitlines()[0])["loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parallel
def test_tp2_dp2_capture_stores_every_sample_once(reference, tmp_path, micro_target):
    sharded = _with_data_of(reference, tmp_path / "tp2dp2", micro_target)
    _torchrun(4, *_cli("capture", sharded, "target.parallel.tp=2"), timeout=900)
    store = capture.capture_dir(sharded)
    manifest = artifacts.read_manifest(store, "capture")
    assert {s["file"][:10] for s in manifest["shards"]} == {"shard-r000", "shard-r001"}  # replicas 0 and 1
    samples = [i for e in capture.read_progress(store) for i in e["samples"]]
    assert sorted(samples) == list(range(manifest["num_samples"])) == list(range(len(load_train(sharded)[0])))
    _assert_same_store(CaptureStore(store), CaptureStore(capture.capture_dir(reference)))


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    import psutil
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "draftsmith.cli" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


@pytest.mark.slow
@pytest.mark.parallel
def test_kill_9_of_one_rank_during_tp2_capture_resumes(reference, tmp_path, micro_target):
    small_shards = ("capture.shard_size_mb=0.02", "capture.batch_tokens=256")
    sharded = _with_data_of(reference, tmp_path / "killed", micro_target, *small_shards)
    store = capture.capture_dir(sharded)
    launcher = _torchrun(2, *_cli("capture", sharded, "target.parallel.tp=2", *small_shards), popen=True)
    deadline = time.time() + 300
    while time.time() < deadline and len(capture.read_progress(store)) < 3 and launcher.poll() is None:
        time.sleep(0.05)
    pid = _rank_pid(launcher, 1)
    assert pid is not None and launcher.poll() is None, "the capture ended before it could be killed"
    os.kill(pid, signal.SIGKILL)
    assert launcher.wait(timeout=300) != 0
    partial = [i for e in capture.read_progress(store) for i in e["samples"]]
    assert 0 < len(partial) < len(load_train(sharded)[0]) and not (store / "manifest.json").exists()
    _torchrun(2, *_cli("capture", sharded, "target.parallel.tp=2", *small_shards))
    samples = [i for e in capture.read_progress(store) for i in e["samples"]]
    assert sorted(samples) == list(range(len(load_train(sharded)[0])))        # nothing lost, nothing twice
    assert capture.verify(store) == []
    _assert_same_store(CaptureStore(store), CaptureStore(capture.capture_dir(reference)))


@pytest.fixture(scope="module")
def chatty_target(tmp_path_factory, micro_target) -> Path:
    """The micro target with an end-of-sequence id it never emits: every answer runs its full length."""
    from transformers import GenerationConfig
    path = shutil.copytree(micro_target, tmp_path_factory.mktemp("chatty") / "target")
    config = GenerationConfig.from_pretrained(path)
    config.eos_token_id = 511
    config.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("procs,layout", [(2, "tp=2"), (2, "pp=2"), (4, "tp=2")], ids=["tp2", "pp2", "tp2xdp2"])
def test_sharded_regeneration_gives_the_same_turns(tmp_path, chatty_target, procs, layout):
    """Batched generation on a target split over 2 processes, by tensor (tp 2) or by layers (pp 2), and
    on two tp 2 replicas (4 processes), each regenerating its share: every turn as one process has it,
    each conversation once, the replicas' files folded into the one regeneration file."""
    regen = ("data.max_conversations=8", "data.regen.max_new_tokens=16", "data.regen.batch_size=4")
    one = micro_recipe(tmp_path / "one", chatty_target, *SMALL, *regen)
    run_data(one, regen=True)
    sharded = micro_recipe(tmp_path / "sharded", chatty_target, *SMALL, *regen)
    _torchrun(procs, *_cli("data", sharded, f"target.parallel.{layout}", *regen, flags=("--regen",)))
    assert not list((sharded.run_dir / "data").glob("*.replica*.jsonl"))
    files = [sorted((r.run_dir / "data").glob("regen-*.jsonl")) for r in (one, sharded)]
    assert len(files[0]) == len(files[1]) == 1
    rows = [sorted((json.loads(line) for line in f[0].read_text().splitlines()), key=lambda x: x["id"]) for f in files]
    assert len(rows[1]) == 8 and rows[0] == rows[1]                          # every turn, token for token
    assert manifests_finish(one) == {"length": 8}                             # 16 new tokens in every answer
    manifests = [artifacts.read_json(r.run_dir / "data" / artifacts.MANIFEST) for r in (one, sharded)]
    assert manifests[0]["num_tokens"] == manifests[1]["num_tokens"]
    assert manifests[1]["regeneration"]["regenerated"] == 8 and manifests[1]["regeneration"]["failed"] == 0


@pytest.mark.slow
@pytest.mark.parallel
def test_tp2_online_training_first_step_equals_one_process(reference, tmp_path, micro_target):
    from draftsmith.train.run import run_train
    online = ("capture.mode=online", "train.max_steps=1", "train.eval_every=1000")
    one = _with_data_of(reference, tmp_path / "one", micro_target, *online)
    run_train(one)
    sharded = _with_data_of(reference, tmp_path / "tp2", micro_target, *online)
    _torchrun(2, *_cli("train", sharded, "target.parallel.tp=2", *online))
    first = [json.loads((r.run_dir / "train" / "metrics.jsonl").read_text().splitlines()[0]) for r in (one, sharded)]
    assert first[1]["loss"] == pytest.approx(first[0]["loss"], rel=1e-5)
    assert first[1]["tokens"] == first[0]["tokens"]                           # the replica's two ranks: one batch
    assert artifacts.read_manifest(sharded.run_dir / "head", "train")["steps"] == 1


JOINT = ("head.kind=medusa", "capture.mode=online", "train.max_steps=4", "train.save_every=2", "train.log_every=1",
         "train.eval_every=1000", "head.lora={rank: 4, alpha: 8, heads_only_steps: 1, heads_ramp: constant}")


def _steps(recipe) -> dict[int, dict]:
    rows = map(json.loads, (recipe.run_dir / "train" / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in rows if "loss" in r and "eval" not in r}


@pytest.mark.slow
@pytest.mark.parallel
def test_tp2_joint_training_equals_one_process_and_resumes_in_one_process(reference, tmp_path, micro_target):
    """Medusa-2 (LoRA adapters on the target, KL self-distillation) at tp 2: peft shards the adapters as
    transformers shards the target. Same losses and gradient norms as one process, step by step through
    the heads-only stage into the joint one; a checkpoint written at tp 2 holds whole tensors, so one
    process resumes it and continues the same curve."""
    from safetensors.torch import load_file
    from draftsmith.train.run import run_train
    one = _with_data_of(reference, tmp_path / "one", micro_target, *JOINT)
    run_train(one)
    sharded = _with_data_of(reference, tmp_path / "tp2", micro_target, *JOINT)
    _torchrun(2, *_cli("train", sharded, "target.parallel.tp=2", *JOINT))
    ours, theirs = _steps(sharded), _steps(one)
    assert sorted(ours) == [1, 2, 3, 4] and [ours[s]["stage"] for s in ours] == [1.0, 2.0, 2.0, 2.0]
    assert ours[1]["loss"] == pytest.approx(theirs[1]["loss"], rel=1e-5)
    for step in (2, 3, 4):                                                   # the adapters in play from step 2
        for key in ("loss", "kl", "head_loss", "grad_norm"):
            assert ours[step][key] == pytest.approx(theirs[step][key], rel=1e-4, abs=1e-7), (step, key)
    adapters = [load_file(str(r.run_dir / "head" / "lora" / "adapter_model.safetensors")) for r in (one, sharded)]
    assert set(adapters[0]) == set(adapters[1]) and any(v.any() for k, v in adapters[1].items() if "lora_B" in k)
    for name, value in adapters[0].items():                                  # whole tensors, same shapes
        assert adapters[1][name].shape == value.shape, name
        assert torch.allclose(adapters[1][name], value, rtol=1e-3, atol=1e-6), name
    # the tp 2 run's step-2 checkpoint, resumed by one process: steps 3 and 4 as the tp 2 run had them
    resumed = _with_data_of(reference, tmp_path / "resumed", micro_target, *JOINT)
    shutil.copytree(sharded.run_dir / "train" / "checkpoints", resumed.run_dir / "train" / "checkpoints")
    _torchrun(1, *_cli("train", resumed, *JOINT))                            # the tp 2 run's recipe, tp 1
    again = _steps(resumed)
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        assert again[step]["loss"] == pytest.approx(ours[step]["loss"], rel=1e-4), step


@pytest.mark.slow
@pytest.mark.parallel
def test_tp2_dp2_joint_training_equals_whole_target_replicas(reference, tmp_path, micro_target):
    """Two tp 2 replicas (4 processes) against two whole-target replicas under DDP: the adapters' shards,
    which DDP cannot hold, are averaged over the replicas by the trainer, so the curves are the same."""
    runs = {}
    for name, procs, layout in (("dp2", 2, ()), ("tp2dp2", 4, ("target.parallel.tp=2",))):
        recipe = _with_data_of(reference, tmp_path / name, micro_target, *JOINT)
        _torchrun(procs, *_cli("train", recipe, *JOINT, *layout))
        runs[name] = _steps(recipe)
    assert sorted(runs["tp2dp2"]) == [1, 2, 3, 4]
    for step, row in runs["dp2"].items():
        assert runs["tp2dp2"][step]["tokens"] == row["tokens"]                # each replica its own batch
        for key in ("loss", "kl", "head_loss", "grad_norm"):
            if key in row:
                assert runs["tp2dp2"][step][key] == pytest.approx(row[key], rel=1e-4, abs=1e-7), (step, key)


@pytest.fixture(scope="module")
def deepseek_target(tmp_path_factory, micro_target) -> Path:
    """A tiny DeepSeek-V3 (MLA attention, 4 routed experts + 1 shared, first layer dense; random weights)
    with the micro target's tokenizer."""
    return _random_target(tmp_path_factory, micro_target, "deepseek_v3", vocab_size=512, hidden_size=64,
                          intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                          n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                          qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512,
                          tie_word_embeddings=False)


JOINT_MTP = ("head.kind=mtp", "head.ttt_steps=2", "capture.mode=online", "train.max_steps=3", "train.log_every=1",
             "train.eval_every=1000", "head.lora={rank: 4, alpha: 8, heads_only_steps: 1, heads_ramp: constant, "
             "target_modules: [q_b_proj, kv_b_proj, o_proj]}")


@pytest.mark.slow
@pytest.mark.parallel
def test_tp2_ep2_joint_mtp_on_deepseek_v3_equals_one_process(tmp_path, deepseek_target):
    """Joint MTP (the DeepSeek-V3 recipe's joint variant) on a target split by tensor and expert
    parallelism: the same losses, step by step, as one process."""
    runs = {}
    for name, procs, layout in (("one", 1, ()), ("tp2ep2", 2, ("target.parallel.tp=2", "target.parallel.ep=2"))):
        recipe = recipe_mod.load(MICRO, [f"out_dir={tmp_path / name}", f"target.model={deepseek_target}", *SMALL, *JOINT_MTP])
        subprocess.run([sys.executable, *_cli("data", recipe, *JOINT_MTP)], cwd=ROOT, check=True, capture_output=True, timeout=600)
        _torchrun(procs, *_cli("train", recipe, *JOINT_MTP, *layout))
        runs[name] = _steps(recipe)
    assert sorted(runs["tp2ep2"]) == [1, 2, 3]
    for step, row in runs["one"].items():
        for key in ("loss", "head_loss", "kl", "grad_norm"):
            if key in row:
                assert runs["tp2ep2"][step][key] == pytest.approx(row[key], rel=1e-4, abs=1e-7), (step, key)


def test_lora_on_fused_experts_is_refused_on_a_sharded_target():
    from draftsmith.recipe import LoraJointConfig
    from draftsmith.targets.lora import check_sharded_lora
    deepseek = target_config("deepseek-ai/DeepSeek-V3")
    with pytest.raises(ValueError, match=r"\['down_proj', 'gate_proj', 'up_proj'\] adapt the fused expert weights.*tp=2"):
        check_sharded_lora(LoraJointConfig(), deepseek, Layout(tp=2, ep=2, world=2))
    check_sharded_lora(LoraJointConfig(), deepseek, Layout())                         # one process: peft adapts them
    check_sharded_lora(LoraJointConfig(target_modules=["q_b_proj", "kv_b_proj", "o_proj"]), deepseek, Layout(tp=2, world=2))
    check_sharded_lora(LoraJointConfig(), target_config("meta-llama/Llama-3.3-70B-Instruct"), Layout(tp=8, world=8))


@pytest.mark.slow
@pytest.mark.parallel
def test_tp2_runtime_decodes_like_one_process(micro_pipeline, tmp_path):
    """Greedy plain and speculative decoding on a tp 2 target: the same tokens and accepted lengths as
    one process; each rank holds half the KV cache and about half the weights, as the plan says."""
    over = [f"out_dir={micro_pipeline.out_dir}", f"target.model={micro_pipeline.target.model}", "validate.max_new_tokens=32"]
    worker = str(ROOT / "tests" / "parallel_worker.py")
    subprocess.run([sys.executable, worker, str(tmp_path / "one.json"), str(MICRO), *over], check=True,
                   capture_output=True, cwd=ROOT, timeout=600)
    _torchrun(2, worker, str(tmp_path / "tp2.json"), str(MICRO), *over, "target.parallel.tp=2")
    one, tp2 = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "tp2"))
    assert one["rows"] == tp2["rows"]
    assert all(r["plain"] == r["spec"] and len(r["plain"]) == 32 for r in tp2["rows"])
    assert sum(len(r["accept"]) for r in tp2["rows"]) < 3 * 32                 # drafts were accepted
    facts = plan.target_facts(target_config_of(micro_pipeline))
    b = 2 if "bf16" in micro_pipeline.target.dtype else 4
    for rank in tp2["ranks"]:
        assert rank["kv_bytes"] * 2 == one["ranks"][0]["kv_bytes"]
        assert rank["kv_bytes"] == pytest.approx(plan.kv_cache_bytes(facts, rank["max_len"], Layout(tp=2, world=2), b), rel=0.2)
        assert rank["weight_bytes"] == pytest.approx(plan.weight_bytes(facts, Layout(tp=2, world=2), b), rel=0.2)
    assert one["validation"]["exact_match"] and tp2["validation"]["exact_match"]
    assert tp2["validation"]["tau"] == one["validation"]["tau"]


@pytest.fixture(scope="module")
def wide_target(tmp_path_factory, micro_target) -> Path:
    """A random Llama of 200M parameters (800 MB in fp32) with the micro target's tokenizer: big enough
    that its weights and activations stand out of the interpreter's own memory."""
    return _random_target(tmp_path_factory, micro_target, "llama", hidden_size=1024, intermediate_size=4096,
                          num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8, vocab_size=512,
                          max_position_embeddings=512)


@pytest.mark.slow
@pytest.mark.parallel
def test_plan_capture_memory_agrees_with_measured_peak(tmp_path, wide_target):
    """`draftsmith plan`'s per-device formula against the capture stage's measured memory, per rank, in
    one process and at tp 2: each rank's weights are its shard, and weights + activation peak (+ the
    store's host buffers, which a CPU's RSS holds too) fall within 20% of the plan."""
    over = [f"target.model={wide_target}", "data.max_conversations=20", "capture.dtype=fp32", "target.dtype=fp32"]
    worker = str(ROOT / "tests" / "memory_worker.py")
    measured = {}
    for tp in (1, 2):
        recipe = recipe_mod.load(MICRO, [f"out_dir={tmp_path / f'tp{tp}'}", *over])
        run_data(recipe)
        _torchrun(tp, worker, str(tmp_path / f"tp{tp}.json"), str(MICRO), f"out_dir={recipe.out_dir}", *over,
                  f"target.parallel.tp={tp}")
        measured[tp] = json.loads((tmp_path / f"tp{tp}.json").read_text())
    for tp, ranks in measured.items():
        assert len(ranks) == tp
        for rank in ranks:
            predicted = rank["plan"]
            assert rank["weights"] == pytest.approx(predicted["weights"], rel=0.01), tp
            assert rank["weights"] + rank["activations"] == pytest.approx(
                predicted["total"] + predicted[plan.HOST], rel=0.2), (tp, rank)
    assert all(r["weights"] * 2 == pytest.approx(measured[1][0]["weights"], rel=0.01) for r in measured[2])


@pytest.fixture(scope="module")
def moe_target(tmp_path_factory, micro_target) -> Path:
    """A tiny Qwen3-MoE (4 experts, 2 per token, random weights) with the micro target's tokenizer."""
    return _random_target(tmp_path_factory, micro_target, "qwen3_moe", hidden_size=64, intermediate_size=128,
                          moe_intermediate_size=32, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_experts=4, num_experts_per_tok=2, vocab_size=512, tie_word_embeddings=False,
                          max_position_embeddings=512)


@pytest.mark.slow
@pytest.mark.parallel
def test_tp2_ep2_capture_of_a_mixture_of_experts_equals_one_process(tmp_path, moe_target):
    one = micro_recipe(tmp_path / "one", moe_target, *SMALL, "data.max_conversations=16")
    run_data(one)
    capture.run_capture(one, capture_needs(one.head.kind))
    sharded = micro_recipe(tmp_path / "tp2", moe_target, *SMALL, "data.max_conversations=16")
    shutil.copytree(one.run_dir / "data", sharded.run_dir / "data")
    _torchrun(2, *_cli("capture", sharded, "target.parallel.tp=2", "target.parallel.ep=2", "data.max_conversations=16"))
    _assert_same_store(CaptureStore(capture.capture_dir(sharded)), CaptureStore(capture.capture_dir(one)))


def manifests_finish(recipe) -> dict:
    return artifacts.read_json(recipe.run_dir / "data" / artifacts.MANIFEST)["regeneration"]["finish_reasons"]


def target_config_of(recipe):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(recipe.target.model)


@pytest.mark.slow
@pytest.mark.parallel
def test_tp2_economics_sweep_runs_one_replica_and_writes_once(micro_pipeline, tmp_path):
    over = [f"out_dir={micro_pipeline.out_dir}", f"target.model={micro_pipeline.target.model}", "economics.batch_sizes=[1,2]",
            "economics.num_speculative_tokens=[2]", "economics.baselines=[ngram]", "economics.num_prompts=2",
            "economics.max_new_tokens=8"]
    from draftsmith import cli
    assert cli.main(["economics", "--recipe", str(MICRO), "--out", str(tmp_path / "one"), *over]) == 0
    _torchrun(2, "-m", "draftsmith.cli", "economics", "--recipe", str(MICRO), "--out", str(tmp_path / "tp2"), *over,
              "target.parallel.tp=2")
    one, tp2 = (json.loads((tmp_path / n / "economics.json").read_text()) for n in ("one", "tp2"))
    assert not (tmp_path / "tp2" / "partial.json").exists()
    for name in ("eagle3", "ngram"):
        a, b = one["drafters"][name], tp2["drafters"][name]
        assert b["exact_rows"] == b["rows"] == a["rows"]
        assert [c["2"]["tau"] for c in b["cells"].values()] == [c["2"]["tau"] for c in a["cells"].values()]


@pytest.mark.parametrize("num_processes", [2, 4])
@pytest.mark.slow
@pytest.mark.parallel
def test_sequence_parallel_loss_and_gradients_equal_one_process(tmp_path, num_processes):
    """One sample of 41 tokens (not a multiple of the group: the last shard is padded) split over 2 and 4
    gloo processes, EAGLE-3, EAGLE-2 and MTP, with and without step checkpointing and small blocks: every
    metric and every gradient summed over the group equals the whole sample's in one process."""
    out = tmp_path / "sp.json"
    _torchrun(num_processes, str(ROOT / "tests" / "sequence_parallel_worker.py"), str(out), "41", timeout=900)
    worst = json.loads(out.read_text())
    assert set(worst) == {"eagle3", "eagle3+ckpt", "eagle2", "eagle2+ckpt", "mtp", "mtp+ckpt"}
    for case, result in worst.items():
        assert result["num_compared"] > 10 and result["max"] < 1e-4, (case, result)
