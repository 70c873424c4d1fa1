"""Drafting with an EAGLE-2 head: the shared tree drafter (heads/drafting.py: committed-only draft
KV cache, EAGLE-2's top-k expansion and global rerank, chains), top-k over the full vocabulary,
fed the target's final hidden state as it is (the head's fc reads it together with the token)."""
from __future__ import annotations

from draftsmith.heads.drafting import TreeDrafter


class Eagle2Drafter(TreeDrafter):
    """The target's final normed hidden state is the first step's feature, unchanged."""
