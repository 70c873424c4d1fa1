"""The one trainer: exact resume after a kill, checkpoints, 2-process DDP and DeepSpeed ZeRO-2,
online mode through the capture code path, and the golden first losses."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, micro_recipe
from draftsmith import artifacts
from draftsmith.data.capture import run_capture
from draftsmith.data.prepare import run_data
from draftsmith.heads.registry import capture_needs
from draftsmith.train.trainer import complete_checkpoints, head_dir, train_dir

MICRO = str(ROOT / "recipes/demo/micro-eagle3.yaml")
GOLDEN = Path(__file__).parent / "golden" / "micro_first_losses.json"


def _losses(recipe) -> dict[int, float]:
    lines = (train_dir(recipe) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r and "eval" not in r}


def _train_cmd(recipe, *extra):
    return [sys.executable, "-m", "draftsmith.cli", "train", "--recipe", MICRO, f"out_dir={recipe.out_dir}",
            f"target.model={recipe.target.model}", "train.log_every=1", *extra]


@pytest.fixture(scope="module")
def captured(tmp_path_factory, micro_target):
    """data + capture once; each test copies the run directory."""
    base = tmp_path_factory.mktemp("trainer")
    recipe = micro_recipe(base, micro_target, "data.max_conversations=80")
    run_data(recipe)
    run_capture(recipe, capture_needs(recipe.head.kind))
    return recipe


def _copy_run(captured, dst: Path):
    import shutil
    shutil.copytree(captured.run_dir, dst / captured.name)
    return micro_recipe(dst, captured.target.model, "data.max_conversations=80")


@pytest.mark.slow
@pytest.mark.long
def test_kill_and_resume_continues_the_same_loss_curve(captured, tmp_path):
    straight = _copy_run(captured, tmp_path / "a")
    args = ["data.max_conversations=80", "train.max_steps=12", "train.save_every=6"]
    subprocess.run(_train_cmd(straight, *args), check=True, capture_output=True)
    killed = _copy_run(captured, tmp_path / "b")
    die_after_8 = [sys.executable, str(Path(__file__).parent / "fixtures" / "train_until_killed.py"), "8"]
    proc = subprocess.run(die_after_8 + _train_cmd(killed, *args)[3:], capture_output=True)  # 2 steps after the step-6 checkpoint
    assert proc.returncode == 9
    assert [p.name for p in complete_checkpoints(train_dir(killed) / "checkpoints")] == ["step-00000006"]
    assert not head_dir(killed).exists()
    resumed = subprocess.run(_train_cmd(killed, *args), check=True, capture_output=True, text=True)
    assert "resumed from" in resumed.stdout
    a, b = _losses(straight), _losses(killed)
    assert sorted(a) == list(range(1, 13))
    for step in range(1, 13):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    wa, _ = artifacts.load_checkpoint(head_dir(straight))
    wb, _ = artifacts.load_checkpoint(head_dir(killed))
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6)


def test_half_written_checkpoint_is_never_picked(captured, tmp_path):
    recipe = _copy_run(captured, tmp_path)
    root = train_dir(recipe) / "checkpoints"
    (root / ".step-00000004.partial" / "head").mkdir(parents=True)
    (root / "step-00000008" / "head").mkdir(parents=True)       # no COMPLETE marker: torn
    assert complete_checkpoints(root) == []


def test_keep_last_and_checkpoint_metadata(captured, tmp_path):
    from draftsmith.train.run import run_train
    recipe = _copy_run(captured, tmp_path)
    recipe.train.max_steps, recipe.train.save_every, recipe.train.keep_last = 9, 2, 2
    run_train(recipe)
    names = [p.name for p in complete_checkpoints(train_dir(recipe) / "checkpoints")]
    assert names == ["step-00000006", "step-00000008"]
    tensors, meta = artifacts.load_checkpoint(head_dir(recipe))
    assert meta["kind"] == "eagle3" and meta["step"] == 9 and meta["target_id"] == recipe.target.model
    assert meta["layer_ids"] == [2, 4, 5] and "embed_tokens.weight" not in tensors
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert meta["recipe"]["train"]["max_steps"] == 9


def test_resume_refuses_checkpoints_of_another_recipe(captured, tmp_path):
    from draftsmith.train.run import build_trainer
    recipe = _copy_run(captured, tmp_path)
    recipe.train.max_steps, recipe.train.save_every = 4, 2
    trainer = build_trainer(recipe)
    trainer.run()
    recipe.train.lr = 0.5
    with pytest.raises(artifacts.ArtifactError, match="another recipe"):
        build_trainer(recipe).resume()


def test_a_non_finite_loss_stops_training_naming_the_step(captured, tmp_path):
    """A head whose loss is NaN (a fresh block left uninitialised, say) stops at that step, before the update
    or any checkpoint, instead of training NaN weights to the end."""
    from draftsmith.train.run import build_trainer
    recipe = _copy_run(captured, tmp_path)
    recipe.train.max_steps, recipe.train.save_every = 3, 1
    trainer = build_trainer(recipe)
    batches = trainer.micro_batches()
    trainer.train_step(next(batches))
    head = trainer.accelerator.unwrap_model(trainer.model)
    weight = head.fc.weight
    with torch.no_grad():
        weight[0, 0] = float("nan")
    before = weight.detach().clone()
    with pytest.raises(FloatingPointError, match=r"non-finite loss .* at step 0 \(micro step 1\)"):
        trainer.train_step(next(batches))
    assert torch.equal(weight.detach()[1:], before[1:])   # no update applied
    assert not (head_dir(recipe) / "model.safetensors").exists()


def test_online_mode_gives_the_offline_first_loss(captured, tmp_path):
    """Online mode runs the target in-process through the capture code path: same first loss
    (up to the bf16 rounding of the store)."""
    from draftsmith.train.run import build_trainer
    offline = _copy_run(captured, tmp_path / "off")
    offline.train.max_steps = 1
    online = _copy_run(captured, tmp_path / "on")
    online.train.max_steps, online.capture.mode = 1, "online"
    a, b = build_trainer(offline), build_trainer(online)
    la = a.train_step(next(a.micro_batches()))["loss"]
    lb = b.train_step(next(b.micro_batches()))["loss"]
    assert float(la) == pytest.approx(float(lb), rel=2e-2)


def test_compact_and_full_stores_give_the_same_losses(tmp_path, micro_target):
    """fp32 stores: the compact layout (features rebuilt on the device) trains exactly like the full one."""
    from draftsmith.train.run import build_trainer
    losses = {}
    for layout in ("true", "false"):
        recipe = micro_recipe(tmp_path / layout, micro_target, "data.max_conversations=40", "capture.dtype=fp32",
                              f"capture.recompute={layout}", "train.max_steps=3")
        run_data(recipe)
        run_capture(recipe, capture_needs(recipe.head.kind))
        trainer = build_trainer(recipe)
        assert (trainer.completer is not None) == (layout == "true")
        losses[layout] = [float(trainer.train_step(b)["loss"]) for b, _ in zip(trainer.micro_batches(), range(3))]
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-4)


def test_golden_first_losses(captured, tmp_path):
    """The micro recipe's first losses must not drift (regenerate with DRAFTSMITH_WRITE_GOLDEN=1)."""
    from draftsmith.train.run import build_trainer
    recipe = _copy_run(captured, tmp_path)
    recipe.train.max_steps, recipe.train.log_every = 5, 1
    trainer = build_trainer(recipe)
    losses = [float(trainer.train_step(b)["loss"]) for b, _ in zip(trainer.micro_batches(), range(5))]
    if os.environ.get("DRAFTSMITH_WRITE_GOLDEN"):
        GOLDEN.write_text(json.dumps({"losses": losses}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert losses == pytest.approx(golden, rel=1e-3)
    assert losses[-1] < losses[0]


def _launch(config: str, recipe, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, str(ROOT / "train_eagle3.py"),
           "--recipe", MICRO, f"out_dir={recipe.out_dir}", f"target.model={recipe.target.model}", "train.log_every=1",
           "data.max_conversations=80", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("config", ["cpu2.yaml", "zero2-cpu.yaml"])
def test_two_process_first_step_matches_single_process(captured, tmp_path, config):
    """Rank 0's first micro-batch is the single-process run's first batch split in two: rank 0's
    loss on its half equals the single-process loss computed on that same half."""
    from draftsmith.train.batches import epoch_order
    from draftsmith.train.run import build_trainer
    recipe = _copy_run(captured, tmp_path / "dist")
    proc = _launch(str(Path(__file__).parent / "fixtures" / config if "zero" in config else ROOT / "recipes/launch" / config),
                   recipe, "train.max_steps=2", "train.batch_size=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = _losses(recipe)[1]
    single = _copy_run(captured, tmp_path / "single")
    single.train.max_steps, single.train.batch_size = 1, 2
    trainer = build_trainer(single)
    rank0 = epoch_order(len(trainer.source), single.train.seed, 0, 0, 2, 2)[0]
    assert float(trainer.train_step(rank0)["loss"]) == pytest.approx(first, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parallel
def test_sequence_parallel_training_follows_the_single_process_curve(captured, tmp_path):
    """train.sequence_parallel=2 on 2 processes (DDP, gloo): both ranks read the same samples and split their
    positions, so the run follows the one-process run step by step (loss and updates), where plain data
    parallelism would read other samples."""
    extra = ["train.max_steps=3", "train.batch_size=2", "train.max_grad_norm=100", "head.ttt_steps=3"]
    parallel = _copy_run(captured, tmp_path / "sp")
    proc = _launch(str(ROOT / "recipes/launch/cpu2.yaml"), parallel, *extra, "train.sequence_parallel=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = _copy_run(captured, tmp_path / "single")
    subprocess.run(_train_cmd(single, "data.max_conversations=80", *extra), check=True, capture_output=True)
    ours, reference = _losses(parallel), _losses(single)
    assert sorted(ours) == sorted(reference) == [1, 2, 3]
    for step in reference:
        assert ours[step] == pytest.approx(reference[step], rel=1e-4), step


def test_sequence_parallel_refusals_name_the_key(captured, tmp_path):
    from draftsmith.train.run import build_trainer
    recipe = _copy_run(captured, tmp_path / "r")
    recipe.train.sequence_parallel = 2
    with pytest.raises(ValueError, match=r"train.sequence_parallel=2: the 1 data-parallel processes are not a multiple"):
        build_trainer(recipe)


@pytest.mark.slow
def test_fsdp2_first_step_matches_single_process(captured, tmp_path):
    """recipes/launch/fsdp.yaml's path (FSDP2 `fully_shard`, NO_WRAP) on 2 CPU processes: the head is
    sharded (DTensor parameters), and rank 0's first-step loss equals the single-process loss on the
    same half batch. (accelerate's own FSDP plugin runs only on GPU processes; see the fixture.)"""
    from draftsmith.train.batches import epoch_order
    from draftsmith.train.run import build_trainer
    recipe = _copy_run(captured, tmp_path / "fsdp")
    out = tmp_path / "fsdp.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes/launch/cpu2.yaml"),
           str(Path(__file__).parent / "fixtures" / "fsdp_first_step.py"), str(out), MICRO, f"out_dir={recipe.out_dir}",
           f"target.model={recipe.target.model}", "data.max_conversations=80", "train.batch_size=2",
           "train.tracking.backend=none"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["parameter_types"] == ["DTensor"] and math.isfinite(result["grad_norm"])
    single = _copy_run(captured, tmp_path / "single")
    single.train.max_steps, single.train.batch_size = 1, 2
    trainer = build_trainer(single)
    rank0 = epoch_order(len(trainer.source), single.train.seed, 0, 0, 2, 2)[0]
    assert float(trainer.train_step(rank0)["loss"]) == pytest.approx(result["loss"], rel=1e-4)


def test_wandb_tracker_runs_offline_without_a_key(tmp_path, monkeypatch):
    from draftsmith import recipe as recipe_mod
    from draftsmith.train.tracking import WandbTracker, make_tracker, NullTracker
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    recipe = recipe_mod.loads("name: wb\ntarget: {model: m}\ntrain: {tracking: {project: p, tags: [t1]}}")
    tracker = make_tracker(recipe, tmp_path, is_main=True)
    assert isinstance(tracker, WandbTracker)
    tracker.log({"train/loss": 1.0}, step=1)
    tracker.finish()
    assert list(tmp_path.glob("wandb/offline-run-*"))
    assert isinstance(make_tracker(recipe, tmp_path, is_main=False), NullTracker)
