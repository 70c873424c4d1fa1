"""What every head kind's module shares: the loss is the forward (DDP/FSDP/DeepSpeed hook into
forward), its config dict is what checkpoints and exports record, and the frozen target weights
it holds (`FROZEN` prefixes) are never saved."""
from __future__ import annotations

import torch
from torch import nn


class DraftHead(nn.Module):
    kind: str = ""
    FROZEN: tuple[str, ...] = ("embed_tokens", "rotary")
    config: dict

    def loss(self, batch: dict):
        raise NotImplementedError

    def forward(self, batch: dict):
        return self.loss(batch)

    def draft_config(self) -> dict:
        return dict(self.config)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint keeps (the frozen target weights left out)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(self.FROZEN)}
