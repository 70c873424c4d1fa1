"""`draftsmith <stage> --recipe R [key=value ...]`. No logic of its own: parse, then call the stage."""
from __future__ import annotations

import argparse
import json
import sys

from draftsmith import recipe as recipe_mod

STAGES = {
    "target": "build the embedded default target (tiny Llama + BPE tokenizer trained on stdlib source); "
              "for a real model this only checks that target.model loads",
    "data": "render conversations with the target's chat template into tokens + assistant-only loss masks "
            "(--regen: first replace assistant turns with the target's own answers)",
    "capture": "run the frozen target and store the hidden states the head needs in a sharded, resumable store "
               "(--dry-run: print the projected size; --verify: check every shard's checksum)",
    "train": "train the head with the one trainer (resumes from the last complete checkpoint)",
    "validate": "run tree-verified speculative decoding with the head: tau, acceptance per depth, exactness, speedup",
    "export": "write the validated head in an engine's format (--to sglang|vllm|speculators)",
    "economics": "sweep batch sizes and K with batched speculative decoding, the head next to n-gram and draft-model "
                 "baselines: tokens/s, TPOT, TTFT, crossover, vLLM/SGLang schedule, $/1M tokens (--gpu-hour-usd)",
    "plan": "per-device memory of every stage that runs the target, the smallest tp/pp/ep layout that fits, and the "
            "expected target forwards, from the target's config alone (no weights)",
    "run": "every stage in order, skipping those whose manifest matches the recipe",
    "check": "serving parity before deploying: read an export as its engine does, lint it against the recipe, its "
             "training record and the served target (template and thinking mode, layer ids, rope and norm, draft "
             "vocabulary, dtype, target), decode the validation prompts as the engine serves it and compare with validation",
    "init": "write a commented recipe for a target and a head kind from the target's config alone: layer ids, template "
            "settings, draft vocabulary, the smallest parallel layout, a validation tree for a GPU, launch lines",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description="Train, validate and export speculative-decoding draft heads.")
    sub = parser.add_subparsers(dest="stage", required=True, metavar="stage")
    for name, help_text in STAGES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == "init":
            p.add_argument("--target", required=True, help="model directory, hub id or .gguf file (what target.model takes)")
            p.add_argument("--kind", required=True, help="head kind: eagle3, eagle2, medusa, mtp, dflash, peagle")
            p.add_argument("--out", help="where to write the recipe (default: print it)")
            p.add_argument("--config", help="a config.json (or its directory) to read instead of the target's (offline)")
            p.add_argument("--gpus", type=int, default=8, help="devices the layout is planned for (default 8)")
            p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one device in GB (default 80)")
            continue
        if name == "check":
            p.add_argument("export_dir", help="an exported head directory (<run>/export/<engine>)")
            p.add_argument("--recipe", help="the recipe the head was trained with (default: the one the export records)")
            p.add_argument("--prompts", help="prompts to decode instead of the recipe's validate.prompts (JSONL or builtin:NAME)")
            p.add_argument("--target", help="the target it will be served with (default: the one the export names)")
            p.add_argument("--engine", help="the engine that will load it (default: the one it was exported for)")
            p.add_argument("--chat-template-kwargs", default="{}",
                           help='the chat_template_kwargs requests will carry, as JSON (default {}: the template\'s defaults)')
            p.add_argument("--num-prompts", type=int, help="prompts to decode (default: as many as validation)")
            p.add_argument("--lint-only", action="store_true", help="lint only, no decoding (no target forward)")
            continue
        p.add_argument("--recipe", required=name != "validate" and name != "export", help="recipe YAML (recipes/<target>/<head>.yaml)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=2e-4")
        if name == "data":
            p.add_argument("--regen", action="store_true", help="regenerate assistant turns with the target first")
        if name == "capture":
            p.add_argument("--dry-run", action="store_true", help="print the projected store size and exit")
            p.add_argument("--verify", action="store_true", help="check every shard against the manifest")
        if name == "validate":
            p.add_argument("--head", help="a checkpoint or exported directory (default: <run>/head)")
            p.add_argument("--target", help="target model directory or hub id (default: the recipe's)")
            p.add_argument("--out", help="output directory (default: <run>/validate)")
        if name == "economics":
            p.add_argument("--head", help="a checkpoint or exported directory (default: <run>/head)")
            p.add_argument("--out", help="output directory (default: <run>/economics)")
            p.add_argument("--gpu-hour-usd", type=float, help="price of the serving hardware per hour (default: economics.gpu_hour_usd)")
            p.add_argument("--extra-usd-per-hour", type=float, help="extra $/h a drafter's hardware costs (default: economics.extra_usd_per_hour)")
        if name == "plan":
            p.add_argument("--gpus", type=int, required=True, help="devices in all")
            p.add_argument("--gpu-memory-gb", type=float, required=True, help="memory of one device in GB")
            p.add_argument("--nodes", type=int, default=1)
            p.add_argument("--gpu-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s of one device (H100: 989)")
            p.add_argument("--config", help="a config.json (or its directory) to read instead of target.model's")
        if name == "export":
            p.add_argument("--head", help="checkpoint directory (default: <run>/head)")
            p.add_argument("--to", dest="engine", help="engine format (eagle3: sglang, vllm, speculators)")
            p.add_argument("--out", help="output directory (default: <run>/export/<engine>)")
            p.add_argument("--allow-unvalidated", action="store_true", help="export without a passing validation.json")
    return parser


def _load(args) -> recipe_mod.Recipe:
    from draftsmith.heads.registry import capture_needs
    recipe = recipe_mod.load(args.recipe, args.overrides)
    capture_needs(recipe.head.kind)  # an unknown head.kind fails here, listing the valid kinds
    if args.stage != "plan" or not getattr(args, "config", None):  # every stage reads the target, plan its config
        from draftsmith.targets.loading import check_model_path
        if recipe.target.embedded is None:
            check_model_path(recipe.target.model)
    recipe.run_dir.mkdir(parents=True, exist_ok=True)
    from draftsmith.targets.parallel import is_first_rank
    if is_first_rank():  # the other ranks of a launch resolved the same recipe
        (recipe.run_dir / "recipe.yaml").write_text(recipe_mod.dump(recipe))
    return recipe


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.stage == "init":
            from draftsmith.scaffold import write_recipe
            print(write_recipe(args.target, args.kind, args.out, args.config, args.gpus, args.gpu_memory_gb), end="")
            return 0
        if args.stage == "check":
            from draftsmith import stages
            report, mismatched = stages.stage_check(None, args)
            print(report)
            return 1 if mismatched else 0
        if args.stage in ("validate", "export") and not args.recipe:
            recipe = None
        else:
            recipe = _load(args)
        from draftsmith import stages
        result = stages.dispatch(args.stage, recipe, args)
    except (ValueError, FileNotFoundError) as exc:  # user-caused: RecipeError, ArtifactError, DataError...
        print(f"draftsmith {args.stage}: error: {exc}", file=sys.stderr)
        return 2
    from draftsmith.targets import parallel
    parallel.shutdown()
    if result is not None:
        print(json.dumps(result, indent=2, default=str) if not isinstance(result, str) else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
