"""Drafting with an MTP module through the shared tree drafter (heads/drafting.py): chains and
EAGLE-2 dynamic trees over the full vocabulary, the module reused at every depth (vLLM's
`spec_step_idx % num_mtp_layers` with one module; SGLang runs MTP through its EAGLE machinery the
same way). Fed the target's final hidden state as it is (the module's `hnorm` reads it)."""
from __future__ import annotations

from draftsmith.heads.drafting import TreeDrafter


class MTPDrafter(TreeDrafter):
    def __init__(self, head, max_len, tree, compile_step=None, batch_size: int = 1):
        if head.num_modules != 1:
            raise ValueError(f"this MTP head has {head.num_modules} modules; draftsmith's runtime drafts with one "
                             "(num_nextn_predict_layers: 1, as every published MTP model): train with head.num_layers=1")
        super().__init__(head, max_len, tree, batch_size=batch_size, **({"compile_step": compile_step} if compile_step else {}))
