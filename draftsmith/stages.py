"""Stage dispatch and `draftsmith run`: every stage in order, skipping those whose manifest
matches the recipe; once a stage runs, every stage after it runs too."""
from __future__ import annotations

import json
import time
from pathlib import Path

from draftsmith import artifacts
from draftsmith.recipe import Recipe

ORDER = ["target", "data", "capture", "train", "validate", "export"]


def stage_target(recipe: Recipe, args=None):
    from draftsmith.targets import embedded
    from draftsmith.targets.loading import check_model_path
    if recipe.target.embedded is None:
        from draftsmith.targets.loading import local_model, target_config
        check_model_path(recipe.target.model)
        source = local_model(recipe.target.model, recipe.target.dtype)  # a GGUF file is dequantized here, once
        return {"target": recipe.target.model, "architectures": target_config(source).architectures} | (
            {"dequantized": source} if source != recipe.target.model else {})
    result = embedded.build_embedded_target(recipe, recipe.target.model, recipe.data.heldout_fraction)
    if recipe.economics.draft_model_embedded is not None and args is not None:  # `draftsmith target`, not `run`
        result["draft_model"] = embedded.ensure_draft_model(recipe)
    return result


def stage_data(recipe: Recipe, args=None):
    from draftsmith.data.prepare import run_data
    return run_data(recipe, regen=True if args is not None and getattr(args, "regen", False) else None)


def stage_capture(recipe: Recipe, args=None):
    from draftsmith.data import capture
    if args is not None and getattr(args, "verify", False):
        problems = capture.verify(capture.capture_dir(recipe))
        if problems:
            raise artifacts.ArtifactError("capture store failed verification: " + "; ".join(problems))
        return f"{capture.capture_dir(recipe)}: every shard matches its checksum"
    if recipe.capture.mode == "online":
        return "capture.mode=online: the trainer runs the target in-process; nothing to store"
    from draftsmith.heads.registry import capture_needs
    result = capture.run_capture(recipe, capture_needs(recipe.head.kind),
                                 dry_run=bool(args is not None and getattr(args, "dry_run", False)))
    return {k: v for k, v in result.items() if k != "shards"} | ({"num_shards": len(result["shards"])} if "shards" in result else {})


def stage_train(recipe: Recipe, args=None):
    from draftsmith.train.run import run_train
    return run_train(recipe)


def stage_validate(recipe: Recipe | None, args=None):
    from draftsmith.runtime.validate import run_validate
    return run_validate(recipe, head=getattr(args, "head", None), target=getattr(args, "target", None),
                        out=getattr(args, "out", None))


def stage_export(recipe: Recipe | None, args=None):
    """Every format asked for (`--to`, `export.formats`) must be written; without either, every format of
    the kind is tried and those that cannot serve this head are listed as skipped with the reason."""
    from draftsmith.heads.hf_layout import NotServable
    from draftsmith.runtime.export import export_head
    from draftsmith.train.trainer import head_dir
    if recipe is None and not getattr(args, "head", None):
        raise ValueError("export needs --head CKPT or --recipe R")
    head = getattr(args, "head", None) or str(head_dir(recipe))
    engines = [args.engine] if getattr(args, "engine", None) else (recipe.export.formats if recipe else None)
    explicit = bool(engines)
    if not engines:  # every engine the head's kind exports to
        from draftsmith.heads.registry import head_spec
        meta = artifacts.read_json(Path(head) / "head.json")
        formats = head_spec(meta.get("kind", "eagle3")).formats
        engines = formats.engines_for(meta) if hasattr(formats, "engines_for") else list(formats.ADAPTERS)
    dtype = recipe.export.dtype if recipe else "bf16"
    chosen_out = getattr(args, "out", None) if len(engines) == 1 else None  # --out names one engine's folder
    base = Path(recipe.run_dir) if recipe else Path(head).parent
    written, skipped = {}, {}
    for engine in engines:
        try:
            written[engine] = export_head(head, engine, chosen_out or str(base / "export" / engine), dtype=dtype,
                                          allow_unvalidated=bool(getattr(args, "allow_unvalidated", False)))
        except NotServable as exc:
            if explicit:
                raise
            skipped[engine] = str(exc)
            print(f"[draftsmith] export --to {engine}: skipped: {exc}", flush=True)
    return written | ({"skipped": skipped} if skipped else {})


def stage_check(recipe: Recipe | None, args) -> tuple[str, bool]:
    """(the printed report, whether anything mismatched)."""
    from draftsmith.runtime.check import render_check, run_check
    try:
        kwargs = json.loads(args.chat_template_kwargs or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"--chat-template-kwargs {args.chat_template_kwargs!r}: not JSON ({exc})") from None
    result = run_check(args.export_dir, args.recipe, args.prompts, args.target, args.engine, kwargs, args.num_prompts,
                       args.lint_only)
    return render_check(result), bool(result["findings"])


def stage_economics(recipe: Recipe, args=None):
    from draftsmith.runtime.sweep import run_economics
    return run_economics(recipe, head=getattr(args, "head", None), gpu_hour_usd=getattr(args, "gpu_hour_usd", None),
                         extra_usd_per_hour=getattr(args, "extra_usd_per_hour", None), out=getattr(args, "out", None))


def stage_plan(recipe: Recipe, args=None):
    from draftsmith.data.prepare import data_dir
    from draftsmith.plan import make_plan, render_plan
    from draftsmith.targets.loading import target_config
    source = getattr(args, "config", None) or recipe.target.model
    try:
        config = target_config(str(Path(source).parent) if str(source).endswith(".json") else source)
    except (OSError, ValueError) as exc:
        raise ValueError(f"plan: cannot read the target's config from {source!r} ({exc}); pass --config PATH") from None
    manifest = data_dir(recipe) / artifacts.MANIFEST
    counts = artifacts.read_json(manifest) if manifest.exists() else {}
    plan = make_plan(recipe, config, args.gpus, args.gpu_memory_gb, args.nodes, args.gpu_tflops,
                     counts.get("num_tokens"), counts.get("num_train_conversations"))
    return render_plan(plan)


STAGE_FUNCS = {"target": stage_target, "data": stage_data, "capture": stage_capture, "train": stage_train,
               "validate": stage_validate, "export": stage_export, "economics": stage_economics, "plan": stage_plan}


def is_current(stage: str, recipe: Recipe) -> bool:
    """A stage is current when its manifest exists, is complete and was made from these inputs."""
    from draftsmith.data import capture, prepare
    from draftsmith.targets.loading import target_fingerprint
    from draftsmith.train.trainer import head_dir, train_inputs_hash
    if stage == "target":
        if recipe.target.embedded is None:
            return True
        from draftsmith.targets.embedded import embedded_inputs_hash
        return artifacts.stage_is_current(recipe.target.model, "target", embedded_inputs_hash(recipe))
    if stage == "data":
        current = artifacts.stage_is_current(prepare.data_dir(recipe), "data", prepare.inputs_hash(recipe))
        return current and artifacts.read_json(prepare.data_dir(recipe) / artifacts.MANIFEST).get(
            "target_fingerprint") == target_fingerprint(recipe.target.model)
    if stage == "capture":
        return recipe.capture.mode == "online" or artifacts.stage_is_current(
            capture.capture_dir(recipe), "capture", capture.capture_inputs_hash(recipe))
    if stage == "train":
        return artifacts.stage_is_current(head_dir(recipe), "train", train_inputs_hash(recipe))
    if stage == "validate":
        from draftsmith.runtime.validate import validation_is_current
        return validation_is_current(recipe)
    return False


def run_all(recipe: Recipe) -> str:
    started, forced, timings, exported = time.perf_counter(), False, {}, None
    for stage in ORDER:
        if not forced and is_current(stage, recipe):
            print(f"[draftsmith] {stage}: up to date (manifest matches the recipe), skipped", flush=True)
            continue
        print(f"[draftsmith] {stage}: running", flush=True)
        t0 = time.perf_counter()
        if stage == "train":
            from draftsmith.train.trainer import set_aside_stale
            set_aside_stale(recipe)
        from draftsmith.plan import check_before_loading
        check_before_loading(stage, recipe)
        result = STAGE_FUNCS[stage](recipe)
        exported = result if stage == "export" else exported
        timings[stage] = round(time.perf_counter() - t0, 1)
        forced = True
    return summary(recipe, timings, time.perf_counter() - started, exported)


def summary(recipe: Recipe, timings: dict, seconds: float, exported: dict | None = None) -> str:
    """The headline numbers and where every artifact is."""
    from draftsmith.data.capture import capture_dir
    from draftsmith.data.prepare import data_dir
    from draftsmith.runtime.validate import validate_dir
    from draftsmith.train.trainer import head_dir, train_dir
    lines = [f"draftsmith run '{recipe.name}' finished in {seconds:.0f}s (stages run: {timings or 'none'})"]
    target_manifest = Path(recipe.target.model) / artifacts.MANIFEST
    if target_manifest.exists():
        t = json.loads(target_manifest.read_text())
        lines.append(f"  target      {recipe.target.model}  held-out perplexity {t.get('heldout_perplexity')}")
    else:
        lines.append(f"  target      {recipe.target.model}")
    for name, path in [("data", data_dir(recipe)), ("capture", capture_dir(recipe)), ("train", train_dir(recipe)),
                       ("head", head_dir(recipe)), ("validate", validate_dir(recipe)), ("export", recipe.run_dir / "export")]:
        lines.append(f"  {name:<11} {path}")
    val = validate_dir(recipe) / "validation.json"
    if val.exists():
        v = json.loads(val.read_text())
        lines.append(f"  tau {v['tau']:.2f} tokens/forward | speedup {v['speedup_vs_plain']:.2f}x vs plain, "
                     f"{v['speedup_vs_hf_generate']:.2f}x vs HF generate | greedy exact: {v['exact_match']} "
                     f"| passed: {v['passed']}")
        lines += [f"  {domain:<11} tau {s['tau']:.2f}, acceptance by depth {' '.join(f'{a:.2f}' for a in s['acceptance_per_depth'])}"
                  f", {s.get('speedup_vs_plain', 0):.2f}x vs plain, {s.get('speedup_vs_hf_generate', 0):.2f}x vs HF generate "
                  f"({s['num_prompts']} prompts)" for domain, s in v.get("per_domain", {}).items() if domain != "heldout"]
        lines += [f"  WARNING     {warning}" for warning in v.get("warnings", [])]
    if exported:
        lines.append(f"  exported    {', '.join(k for k in exported if k != 'skipped') or 'nothing'}")
        lines += [f"  skipped     {engine}: {why}" for engine, why in exported.get("skipped", {}).items()]
    return "\n".join(lines)


def dispatch(stage: str, recipe: Recipe | None, args):
    if stage == "run":
        return run_all(recipe)
    from draftsmith.plan import check_before_loading
    check_before_loading(stage, recipe, args)  # a sharded target that cannot fit stops here, before its weights
    return STAGE_FUNCS[stage](recipe, args)
