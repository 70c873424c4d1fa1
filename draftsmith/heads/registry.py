"""One registry: head kind -> class. Every head plugs into the one trainer through this interface.

A head class provides:
  - `from_target(target_config, head_cfg, draft_vocab, layer_ids)`: build sized from the target's config;
  - `capture_layers(num_target_layers)`: which hidden states the capture stage must store;
  - `loss(batch) -> (loss, metrics)`: the training objective (the trainer owns everything else);
  - `draft_config()`: the HF-style config dict written into checkpoints and exports;
  - `trainable_state()`: the tensors a checkpoint keeps (frozen target weights left out).
"""
from __future__ import annotations

HEADS: dict[str, type] = {}


def register(kind: str):
    def add(cls):
        HEADS[kind] = cls
        cls.kind = kind
        return cls
    return add


def get_head_class(kind: str) -> type:
    if not HEADS:
        from draftsmith.heads import eagle3  # noqa: F401  (registers itself)
    if kind not in HEADS:
        from draftsmith.recipe import FINAL_FEATURE_KINDS
        if kind in FINAL_FEATURE_KINDS:
            raise ValueError(f"head.kind={kind!r}: its features can be captured, but no {kind} head is trainable in this "
                             f"version; trainable kinds: {', '.join(sorted(HEADS))}")
        raise ValueError(f"head.kind={kind!r} is not a known head kind; valid kinds: {', '.join(sorted(HEADS))}")
    return HEADS[kind]
