"""Run by tests/test_parallel.py, as one process or under torchrun: the capture stage on a target big
enough that its memory shows above the interpreter's, measured against `draftsmith plan`'s formula
for the same recipe and layout. Rank 0 writes to OUT as JSON, per rank: the bytes of its own weights
(its shard) and its activation peak, the growth of peak RSS over the capture forwards (the peak is
reset once the weights are in place; they are first copied out of the safetensors mmap so that
reading them is not counted as new memory), and the plan's parts.

usage: python tests/memory_worker.py OUT RECIPE key=value..."""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch


def _status(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def _in_anonymous_memory(model) -> int:
    """Every weight copied out of the file mapping (each rank's own shard); returns their bytes."""
    total = 0
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param.data
            local.set_(local.clone())
            total += local.numel() * local.element_size()
    return total


def main(out: str, recipe_path: str, *overrides: str) -> None:
    from transformers import AutoConfig
    from draftsmith import plan
    from draftsmith import recipe as recipe_mod
    from draftsmith.data import capture
    from draftsmith.heads.registry import capture_needs
    from draftsmith.targets import loading, parallel
    recipe = recipe_mod.load(recipe_path, list(overrides))
    layout = parallel.layout_for(recipe, "capture")
    measured = {}
    load_target = loading.load_target

    def load_and_mark(*args, **kwargs):
        model = load_target(*args, **kwargs)
        measured["weights"] = _in_anonymous_memory(model)
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")                  # peak RSS := current RSS
        measured["rss_with_weights"] = _status("VmRSS:")
        return model
    loading.load_target = load_and_mark
    capture.run_capture(recipe, capture_needs(recipe.head.kind))
    mine = {"weights": measured["weights"], "activations": _status("VmHWM:") - measured["rss_with_weights"],
            "plan": plan.stage_memory(recipe, plan.target_facts(AutoConfig.from_pretrained(recipe.target.model)),
                                      layout, "capture")}
    per_rank = [mine]
    if torch.distributed.is_initialized():
        per_rank = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(per_rank, mine)
    if layout.rank == 0:
        Path(out).write_text(json.dumps(per_rank))


if __name__ == "__main__":
    main(*sys.argv[1:])
