"""The one trainer. Heads plug in through the registry; accelerate supplies DDP / FSDP / DeepSpeed
(chosen by `accelerate launch --config_file recipes/launch/*.yaml`, never by the recipe).

Exact resume: checkpoints hold the head, optimizer, scheduler and every process's RNG (accelerate
`save_state`) plus the step counter; data order is a pure function of (seed, epoch), so a rerun
after kill -9 continues the same loss curve."""
from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

import torch

from draftsmith import artifacts
from draftsmith.recipe import Recipe
from draftsmith.train import batches as B
from draftsmith.train.tracking import MetricsLog

COMPLETE = "COMPLETE"


def train_dir(recipe: Recipe) -> Path:
    return recipe.run_dir / "train"


def head_dir(recipe: Recipe) -> Path:
    return recipe.run_dir / "head"


def train_inputs_hash(recipe: Recipe) -> str:
    return recipe.section_hash("target", "data", "capture", "head", "train")


CPU_MMAP_THRESHOLD = 1 << 20


def return_freed_memory_on_cpu(threshold: int = CPU_MMAP_THRESHOLD) -> bool:
    """On CPU, tensors come from glibc's malloc, whose adaptive threshold keeps freed blocks of up to 32 MiB
    in its heap: the thousands of activation blocks a long sample frees stay resident (measured at 4096
    tokens, blocks sized as for 32768: a peak 1.7x the one with this setting). A fixed threshold gives every
    allocation of `threshold` bytes or more its own mapping, which free() returns to the system. True if
    set; no-op (False) where the C library is not glibc."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(-3, threshold))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError, TypeError):
        return False


def make_accelerator(recipe: Recipe):
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    kwargs = {}
    if "ACCELERATE_MIXED_PRECISION" not in os.environ:  # a launch config decides when it says so
        kwargs["mixed_precision"] = "bf16" if torch.cuda.is_available() else "no"
    # the schedule is counted in optimizer steps of this process, whatever the world size
    if recipe.head.lora is not None:  # joint: the adapters get no gradient in the heads-only stage
        from accelerate.utils import DistributedDataParallelKwargs
        kwargs["kwargs_handlers"] = [DistributedDataParallelKwargs(find_unused_parameters=True)]
    if not torch.cuda.is_available():
        return_freed_memory_on_cpu()
    accelerator = Accelerator(gradient_accumulation_steps=recipe.train.grad_accum, step_scheduler_with_optimizer=False,
                              cpu=not torch.cuda.is_available(), **kwargs)
    ds = accelerator.state.deepspeed_plugin
    if ds is not None:
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = recipe.train.batch_size
        ds.deepspeed_config["gradient_accumulation_steps"] = recipe.train.grad_accum
        ds.deepspeed_config["gradient_clipping"] = recipe.train.max_grad_norm
    set_seed(recipe.train.seed)
    return accelerator


def lr_lambda(total_steps: int, warmup_ratio: float, start_step: int = 0):
    """Linear warmup then cosine decay over [start_step, total_steps); zero before start_step (a
    param group that joins later, e.g. LoRA adapters after a heads-only stage)."""
    span = max(1, total_steps - start_step)
    warmup = max(1, int(span * warmup_ratio))

    def factor(step: int) -> float:
        if step < start_step:
            return 0.0
        step -= start_step
        total_steps_ = span
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps_ - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress))
    return factor


class Trainer:
    """Owns the loop; the head owns only its loss."""

    def __init__(self, recipe: Recipe, head, source, eval_source, d2t, t2d, lm_head_VH, accelerator, tracker,
                 completer=None):
        self.recipe, self.cfg, self.accelerator, self.tracker = recipe, recipe.train, accelerator, tracker
        self.source, self.eval_source, self.completer = source, eval_source, completer
        self.d2t, self.t2d = d2t.to(accelerator.device), t2d.to(accelerator.device)
        self.lm_head = lm_head_VH.to(accelerator.device)
        # data parallelism runs across target replicas: the ranks of one sharded target replica
        # (target.parallel) read the same batch; with a whole target per rank, replica = rank
        from draftsmith.targets.parallel import layout_for
        layout = layout_for(recipe, "train")
        self.sequence_group, self.sequence_rank = self._sequence_parallel(layout, head)
        size = self.cfg.sequence_parallel  # the ranks of one sequence-parallel group read the same sample
        self.data_world, self.data_rank = layout.dp // size, layout.replica // size
        world, rank = self.data_world, self.data_rank
        self.lengths = source.lengths() if self.cfg.group_by_length else None
        self.batches_per_epoch = len(B.epoch_order(len(source), self.cfg.seed, 0, rank, world, self.cfg.batch_size))
        if self.batches_per_epoch == 0:
            raise ValueError(f"train.batch_size={self.cfg.batch_size} x {world} processes exceeds the {len(source)} training samples")
        steps = self.cfg.max_steps or math.ceil(self.cfg.epochs * self.batches_per_epoch / self.cfg.grad_accum)
        self.total_steps = max(1, steps)
        if hasattr(head, "param_groups"):  # a joint model: heads and adapters on their own schedules
            groups = head.param_groups(self.cfg.lr)
        else:
            groups = [{"params": [p for p in head.parameters() if p.requires_grad], "lr": self.cfg.lr, "start_step": 0}]
        starts = [g.pop("start_step") for g in groups]
        optimizer = torch.optim.AdamW(groups, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, betas=(0.9, 0.95))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lr_lambda(self.total_steps, self.cfg.warmup_ratio, start)
                                                                  for start in starts])
        self.sharded = getattr(head, "sharded", False)  # adapters on a tensor-parallel target: DTensor shards
        self.replica_group = None  # DDP syncs the head only; such adapters are averaged over replicas here
        if self.sharded:
            from draftsmith.targets.parallel import replica_group, whole_optimizer_state
            whole_optimizer_state(optimizer)
            if layout.dp > 1:
                self.replica_group, self.adapters = replica_group(layout), head.adapter_parameters()
        self.model, self.optimizer, self.scheduler = accelerator.prepare(head, optimizer, scheduler)
        self.step = self.micro_step = self.tokens = 0
        self.log = MetricsLog(train_dir(recipe) / "metrics.jsonl", accelerator.is_main_process)

    def _sequence_parallel(self, layout, head):
        """(this rank's sequence-parallel group, its rank in it) under train.sequence_parallel > 1: consecutive
        ranks split each sample's positions (heads/ttt.py SequenceShard); (None, 0) otherwise."""
        size = self.cfg.sequence_parallel
        if size == 1:
            return None, 0
        why = ("train.sequence_parallel must be >= 1" if size < 1 else
               f"the {layout.dp} data-parallel processes are not a multiple of it" if layout.dp % size else
               f"head.kind={head.kind!r} has no sequence-parallel loss (eagle3, eagle2 and mtp have)"
               if not getattr(head, "sequence_parallel", False) else
               "a sharded target (target.parallel) is not combined with it in this release" if layout.tp * layout.pp > 1 else
               "joint training (head.lora) is not combined with it in this release" if self.recipe.head.lora else None)
        if why:
            raise ValueError(f"train.sequence_parallel={size}: {why}")
        import torch.distributed as dist
        world, rank = dist.get_world_size(), dist.get_rank()
        groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(world // size)]
        return groups[rank // size], rank % size

    # ------------------------------------------------------------ batches

    def micro_batches(self):
        """Yield (epoch, indices) from micro_step on: a resumed run starts mid-epoch exactly."""
        world, rank = self.data_world, self.data_rank
        epoch, offset = divmod(self.micro_step, self.batches_per_epoch)
        while True:
            order = B.epoch_order(len(self.source), self.cfg.seed, epoch, rank, world, self.cfg.batch_size, self.lengths)
            for indices in order[offset:]:
                yield indices
            epoch, offset = epoch + 1, 0

    def device_batch(self, records: list[dict]) -> dict:
        batch = B.collate(records, self.cfg.max_batch_tokens)
        batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
        if "aux" not in batch:  # token-only records: a joint model runs the target itself
            batch["loss_valid"] = batch.pop("has_teacher")
            batch["step"] = self.step
            return batch
        if self.completer is not None:
            batch = self.completer(batch)
        elif "teacher" not in batch:  # a final-hidden store: the feature at p is the teacher for token p+1
            batch["teacher"] = batch["aux"]
        batch = B.teacher_targets(batch, self.lm_head, self.d2t, self.t2d)
        if self.sequence_group is not None:
            from draftsmith.heads.ttt import SequenceShard
            batch["sequence_shard"] = SequenceShard.split(batch["input_ids"].shape[1], self.sequence_rank,
                                                          self.cfg.sequence_parallel, self.sequence_group)
        return batch

    # ------------------------------------------------------------ loop

    def train_step(self, indices: list[int]) -> dict:
        records = self.source.records(indices)
        batch = self.device_batch(records)
        with self.accelerator.accumulate(self.model):
            loss, metrics = self.model(batch)
            if not torch.isfinite(loss.detach()):  # stop before a NaN update reaches the weights or a checkpoint
                raise FloatingPointError(
                    f"train: non-finite loss ({float(loss.detach())}) at step {self.step} (micro step {self.micro_step}); "
                    f"nothing of this step was applied and the last checkpoint is intact: check the head's initial "
                    f"weights, train.lr ({self.cfg.lr}) and the data")
            # a shard's loss is its share of the sample's: DDP's mean over all ranks becomes the mean over samples
            self.accelerator.backward(loss * self.cfg.sequence_parallel)
            grad_norm = None
            if self.accelerator.sync_gradients:
                grad_norm = self.clip_gradients()
            self.optimizer.step()
            if self.accelerator.sync_gradients:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.micro_step += 1
        self.tokens += int(batch["input_ids"].numel())
        metrics.setdefault("loss", loss.detach())  # a sequence shard reports the whole sample's
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        return metrics

    def clip_gradients(self):
        if self.replica_group is not None:
            from draftsmith.targets.parallel import average_over_replicas
            average_over_replicas(self.adapters, self.replica_group, self.data_world)
        if self.sharded:  # torch's clip (accelerate's) would take the shards' norms as local ones
            from draftsmith.targets.parallel import clip_grad_norm
            self.accelerator.unscale_gradients()  # fp16 loss scaling, as accelerate's clip does first
            return clip_grad_norm(self.model.parameters(), self.cfg.max_grad_norm)
        return self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)

    def run(self) -> dict:
        from tqdm import tqdm
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", mininterval=2.0,
                   disable=not self.accelerator.is_main_process)
        started, last = time.perf_counter(), {}
        for indices in self.micro_batches():
            if self.step >= self.total_steps:
                break
            metrics = self.train_step(indices)
            if not self.accelerator.sync_gradients:
                continue
            self.step += 1
            bar.update(1)
            if self.step % self.cfg.log_every == 0 or self.step == 1 or self.step == self.total_steps:
                last = self.log_metrics(metrics, started)
            if self.eval_source is not None and self.step % self.cfg.eval_every == 0:
                self.evaluate()
            if self.step % self.cfg.save_every == 0 and self.step < self.total_steps:
                self.save()
        bar.close()
        final_eval = self.evaluate() if self.eval_source is not None else {}
        return {**last, **final_eval}

    def log_metrics(self, metrics: dict, started: float) -> dict:
        values = {k: float(v) for k, v in metrics.items()}
        values.update(step=self.step, lr=self.scheduler.get_last_lr()[0], tokens=self.tokens,
                      tokens_per_s=self.tokens / max(time.perf_counter() - started, 1e-9))
        if self.source.num_corrupt:
            values["corrupt_samples_skipped"] = self.source.num_corrupt
        if torch.cuda.is_available():
            values["max_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        self.log.write(values)
        self.tracker.log({f"train/{k}": v for k, v in values.items() if k != "step"}, self.step)
        return values

    @torch.no_grad()
    def evaluate(self, max_samples: int = 64) -> dict:
        self.model.eval()
        totals, count = {}, 0
        indices = list(range(min(len(self.eval_source), max_samples)))
        for start in range(0, len(indices), self.cfg.batch_size):
            batch = self.device_batch(self.eval_source.records(indices[start:start + self.cfg.batch_size]))
            loss, metrics = self.model(batch)
            metrics.setdefault("loss", loss)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + float(value)
            count += 1
        self.model.train()
        values = {f"eval_{k}": v / max(count, 1) for k, v in totals.items()}
        self.log.write({"step": self.step, "eval": True, **values}, echo=False)
        if self.accelerator.is_main_process:
            print(f"eval step={self.step} loss={values.get('eval_loss', 0):.4f} "
                  f"sim_accept_len={values.get('eval_sim_accept_len', 0):.3f}", flush=True)
        self.tracker.log({k.replace("eval_", "eval/"): v for k, v in values.items()}, self.step)
        return values

    # ------------------------------------------------------------ checkpoints

    def head_tensors(self) -> dict:
        """The trained tensors, whole (a joint model's state_dict gathers tensor-parallel adapters: a
        collective, so every rank calls this)."""
        state = self.accelerator.get_state_dict(self.model)
        unwrapped = self.accelerator.unwrap_model(self.model)
        keep = set(unwrapped.trainable_state())
        return {k: v for k, v in state.items() if k in keep}

    def metadata(self) -> dict:
        unwrapped = self.accelerator.unwrap_model(self.model)
        return {"kind": unwrapped.kind, "target_id": self.recipe.target.model,
                "layer_ids": unwrapped.config["draftsmith"]["layer_ids"], "draft_config": unwrapped.draft_config(),
                "step": self.step, "micro_step": self.micro_step, "tokens": self.tokens,
                "recipe": self.recipe.to_dict(), "recipe_hash": train_inputs_hash(self.recipe)}

    def save(self) -> Path:
        """state/ (optimizer, scheduler, RNG) + head/, then a COMPLETE marker: resume trusts only that."""
        root = train_dir(self.recipe) / "checkpoints"
        final = root / f"step-{self.step:08d}"
        staging = root / f".step-{self.step:08d}.partial"
        if self.accelerator.is_main_process and staging.exists():
            shutil.rmtree(staging)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(staging / "state"))
        tensors = self.head_tensors()
        if self.accelerator.is_main_process:
            artifacts.save_checkpoint(staging / "head", tensors, self.metadata())
            artifacts.write_json(staging / "trainer.json", {"step": self.step, "micro_step": self.micro_step,
                                                            "tokens": self.tokens})
            (staging / COMPLETE).write_text("ok\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            self.prune(root)
        self.accelerator.wait_for_everyone()
        return final

    def prune(self, root: Path) -> None:
        done = complete_checkpoints(root)
        for old in done[:-self.cfg.keep_last] if self.cfg.keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    def resume(self) -> bool:
        done = complete_checkpoints(train_dir(self.recipe) / "checkpoints")
        if not done:
            return False
        latest = done[-1]
        meta = artifacts.read_json(latest / "head" / "head.json")
        if meta.get("recipe_hash") != train_inputs_hash(self.recipe):
            raise artifacts.ArtifactError(f"{latest} was written by another recipe; move {train_dir(self.recipe)} "
                                          "aside or restore the recipe to resume")
        self.accelerator.load_state(str(latest / "state"))
        state = artifacts.read_json(latest / "trainer.json")
        self.step, self.micro_step, self.tokens = state["step"], state["micro_step"], state["tokens"]
        if self.accelerator.is_main_process:
            print(f"resumed from {latest} at step {self.step}", flush=True)
        return True


def set_aside_stale(recipe: Recipe) -> Path | None:
    """`run` retrains when an upstream stage changed: keep the old checkpoints, but out of the way."""
    done = complete_checkpoints(train_dir(recipe) / "checkpoints")
    if not done or artifacts.read_json(done[-1] / "head" / "head.json").get("recipe_hash") == train_inputs_hash(recipe):
        return None
    aside = train_dir(recipe).with_name(f"train.stale-{time.strftime('%Y%m%d-%H%M%S')}")
    os.replace(train_dir(recipe), aside)
    print(f"[draftsmith] checkpoints of an earlier recipe moved to {aside}", flush=True)
    return aside


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step-*") if (p / COMPLETE).exists())
