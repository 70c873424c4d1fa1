"""Joint training of a head and its target (Medusa-2; joint MTP), inside the one trainer.

`JointModel` is what the trainer optimizes: the target with LoRA adapters (targets/lora.py) and the
draft head. Per batch:
  teacher = the target with adapters off, no grad (self-distillation: no second copy in memory)
  stage 1 (step < heads_only_steps): loss = head loss on the teacher's own features
  stage 2: loss = kl_weight · KL(teacher || adapted target) + coefficient · ramp · head loss,
           the head reading the adapted target's features (gradients reach the adapters)
The head's targets are the teacher's distributions. The adapters' learning rate is 0 during
stage 1 and the heads' is `heads_lr_multiplier` x train.lr (param groups, see `param_groups`);
the stage is a function of the step, so resume across the two stages is exact."""
from __future__ import annotations

import math

import torch
from torch import nn

from draftsmith.recipe import LoraJointConfig
from draftsmith.targets.parallel import full, is_sharded, shard_like


def heads_only_steps(cfg: LoraJointConfig, total_steps: int) -> int:
    """Stage 1's length; a stage 1 that fills the whole run would train no adapter and end as Medusa-1 /
    post hoc MTP while calling itself joint, so it is refused before anything loads."""
    steps = cfg.heads_only_steps if cfg.heads_only_steps is not None else total_steps // 3
    if steps >= total_steps:
        raise ValueError(f"head.lora.heads_only_steps={steps} but the run has {total_steps} optimizer steps in all "
                         "(train.epochs/max_steps, batch_size, grad_accum): stage 2, which trains the LoRA adapters, would "
                         "never start; lower head.lora.heads_only_steps (or leave it unset: a third of the run) or train longer")
    return steps


def ramp(kind: str, progress: float) -> float:
    """Weight of the head loss over stage 2 (progress 0 -> 1), as Medusa-2's `medusa_scheduler`."""
    progress = min(max(progress, 0.0), 1.0)
    return {"constant": 1.0, "linear": progress, "sine": math.sin(math.pi / 2 * progress)}[kind]


class JointModel(nn.Module):
    def __init__(self, peft_target, head, cfg: LoraJointConfig, total_steps: int):
        super().__init__()
        self.target, self.head, self.cfg = peft_target, head, cfg
        self.kind, self.config = head.kind, head.config
        self.total_steps, self.stage1_steps = total_steps, heads_only_steps(cfg, total_steps)
        self.sharded = any(is_sharded(p) for p in peft_target.parameters())
        if self.sharded:
            # a tensor-parallel target (DTensor shards, adapters sharded alike by peft): DDP, which cannot
            # hold DTensors, syncs the head only; the ranks of the replica compute the adapters' gradients
            self._ddp_params_and_buffers_to_ignore = [f"target.{name}" for name, _ in
                                                      [*peft_target.named_parameters(), *peft_target.named_buffers()]]

    def adapter_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.target.named_parameters() if p.requires_grad and "lora_" in n]

    def draft_config(self) -> dict:
        return self.head.draft_config()

    def param_groups(self, lr: float) -> list[dict]:
        """Heads at lr x multiplier from step 0; adapters at lr, starting after the heads-only stage."""
        heads = [p for p in self.head.parameters() if p.requires_grad]
        adapters = self.adapter_parameters()
        return [{"params": heads, "lr": lr * self.cfg.heads_lr_multiplier, "start_step": 0},
                {"params": adapters, "lr": lr, "start_step": self.stage1_steps}]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        state = {f"head.{k}": v for k, v in self.head.trainable_state().items()}
        state.update({f"target.{n}": p for n, p in self.target.named_parameters() if "lora_" in n})
        return state

    def state_dict(self, *args, **kwargs):
        """Only what training changes, whole (a tensor-parallel adapter's shards gathered, on every rank):
        checkpoints never carry the frozen target and read the same whatever the layout."""
        state = super().state_dict(*args, **kwargs)
        keep = set(self.trainable_state())
        return type(state)((k, full(v)) for k, v in state.items() if k in keep)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """A checkpoint holds the trained tensors only: the frozen target's are not 'missing'
        (callers such as safetensors' `load_model` check the returned keys themselves)."""
        trained = set(self.trainable_state())
        missing = [k for k in trained if k not in state_dict]
        if strict and missing:
            raise RuntimeError(f"joint checkpoint lacks {missing[:4]}")
        own = self.trainable_state()
        state_dict = {k: shard_like(v, own[k]) if k in own else v for k, v in state_dict.items()}
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        return type(result)([k for k in result.missing_keys if k in trained], result.unexpected_keys)

    def split_state(self, state: dict) -> tuple[dict, dict]:
        """(head tensors, adapter tensors named as the peft model names them)."""
        head = {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")}
        adapter = {k.removeprefix("target."): v for k, v in state.items() if k.startswith("target.")}
        return head, adapter

    def _features(self, ids_BT):
        out = self.target(input_ids=ids_BT, output_hidden_states=True)
        return out.hidden_states[-1], out.logits.float()

    def forward(self, batch: dict):
        return self.loss(batch)

    def loss(self, batch: dict):
        ids, valid = batch["input_ids"], batch["loss_valid"]
        step = int(batch.get("step", 0))
        with torch.no_grad(), self.target.disable_adapter():
            teacher_features, teacher_logits = self._features(ids)
        teacher_logp = torch.log_softmax(teacher_logits, dim=-1)
        probs = teacher_logp.exp()
        head_batch = {"input_ids": ids, "position_ids": batch["position_ids"], "target_probs": probs,
                      "target_valid": valid, "target_argmax": teacher_logits.argmax(-1).masked_fill(~valid, -1)}
        if step < self.stage1_steps:
            head_loss, metrics = self.head.loss({**head_batch, "aux": teacher_features.detach()})
            metrics["stage"] = torch.tensor(1.0)
            return head_loss, metrics
        features, logits = self._features(ids)
        count = valid.sum().clamp(min=1)
        kl = ((probs * (teacher_logp - torch.log_softmax(logits, dim=-1))).sum(-1) * valid).sum() / count
        head_loss, metrics = self.head.loss({**head_batch, "aux": features})
        weight = self.cfg.heads_coefficient * ramp(self.cfg.heads_ramp, (step - self.stage1_steps) /
                                                   max(1, self.total_steps - self.stage1_steps))
        metrics.update(kl=kl.detach(), head_loss=head_loss.detach(), head_weight=torch.tensor(weight),
                       stage=torch.tensor(2.0))
        return self.cfg.kl_weight * kl + weight * head_loss, metrics
