"""Drafting with an EAGLE-3 head: the shared tree drafter (heads/drafting.py: committed-only draft
KV cache, EAGLE-2 dynamic trees and chains over the draft vocabulary, mapped to target ids by d2t),
fed the target's concatenated aux features through `fc`."""
from __future__ import annotations

import torch

from draftsmith.heads.drafting import TreeDrafter


class Eagle3Drafter(TreeDrafter):
    def first_hidden(self, features_TK: torch.Tensor) -> torch.Tensor:
        return self.head.project(features_TK)
