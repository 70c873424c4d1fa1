"""Run by tests/test_parallel.py, as one process or under torchrun with target.parallel.tp > 1: the
runtime on the (sharded) target, greedy plain and speculative decoding with EOS ignored, so every
prompt decodes its full length. Rank 0 writes what every rank saw (tokens, accepted lengths, each
rank's local weight and KV-cache bytes) and the summary of `run_validate` (report in OUT.validate/) to
OUT as JSON.

usage: python tests/parallel_worker.py OUT RECIPE key=value..."""
from __future__ import annotations

import json
import sys

import torch


def main(out: str, recipe_path: str, *overrides: str) -> None:
    from draftsmith import recipe as recipe_mod
    from draftsmith.heads.drafting import TreeConfig
    from draftsmith.heads.registry import head_spec
    from draftsmith.runtime.generate import plain_generate, speculative_generate
    from draftsmith.runtime.target import TargetRunner
    from draftsmith.runtime.loading import load_target_and_head, validation_prompts
    from draftsmith.runtime.validate import run_validate
    from draftsmith.runtime.verify import SamplingConfig
    from draftsmith.targets import parallel
    recipe = recipe_mod.load(recipe_path, list(overrides))
    cfg = recipe.validate
    model, tokenizer, head, _, _ = load_target_and_head(recipe, None)
    prompts = [p for p, _, _ in validation_prompts(recipe, tokenizer, cfg.num_prompts)]
    max_len = max(len(p) for p in prompts) + cfg.max_new_tokens + cfg.num_nodes + 8
    layer_ids = head.config.get("draftsmith", {}).get("layer_ids", [])
    runner = TargetRunner(model, max_len, layer_ids, compile_mode=None)
    drafter = head_spec(head.kind).drafter(head, max_len, TreeConfig(cfg.depth, cfg.top_k, cfg.num_nodes))
    greedy, rows = SamplingConfig(), []
    for prompt in prompts:
        plain = plain_generate(runner, prompt, cfg.max_new_tokens, greedy, set())
        spec = speculative_generate(runner, drafter, prompt, cfg.max_new_tokens, greedy, set())
        rows.append({"plain": plain.tokens, "spec": spec.tokens, "accept": spec.accept_lengths})
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    mine = {"weight_bytes": sum(local(p).numel() * local(p).element_size() for p in model.parameters()),
            "kv_bytes": sum(t.numel() * t.element_size() for layer in runner.cache.layers for t in (layer.keys, layer.values)),
            "max_len": max_len}
    per_rank = [mine]
    if torch.distributed.is_initialized():
        per_rank = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(per_rank, mine)
    validation = run_validate(recipe, out=out + ".validate")
    if parallel.world_and_rank()[1] == 0:
        with open(out, "w") as handle:
            json.dump({"rows": rows, "ranks": per_rank, "validation": validation}, handle)


if __name__ == "__main__":
    main(*sys.argv[1:])
