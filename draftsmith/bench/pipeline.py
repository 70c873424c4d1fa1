"""`make bench` sections `capture`, `layouts`, `train` and `runtime`: capture throughput against a plain
forward and store bytes per token per layout (and each layout's effect on the trained head), training
tokens/s and peak memory for TTT k = 1, 3, 7, and the demo head's validation (tau, speedups)."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftsmith import recipe as recipe_mod
from draftsmith.bench.common import link_data

LAYOUTS = {  # name -> capture overrides; "compact" is the default
    "full-bf16": ["capture.recompute=false", "capture.compression=none", "capture.dtype=bf16"],
    "compact-bf16": ["capture.recompute=true", "capture.compression=zstd", "capture.dtype=bf16"],
    "compact-fp8": ["capture.recompute=true", "capture.compression=zstd", "capture.dtype=fp8"],
}


def bench_capture(recipe_path: str, overrides: list[str], num_samples: int = 256) -> dict:
    """Plain forward (with logits, as a user would run the target) vs our capture path incl.
    compressing and writing shards, per store layout."""
    from draftsmith.data import capture
    from draftsmith.data.prepare import load_train
    from draftsmith.heads.registry import capture_needs
    from draftsmith.targets.features import FeatureExtractor
    from draftsmith.targets.loading import load_target
    recipe = recipe_mod.load(recipe_path, overrides)
    dataset, data_manifest = load_train(recipe)
    model = load_target(recipe)
    cfg = model.config.get_text_config()
    indices = list(range(min(num_samples, len(dataset))))
    batches = capture.plan_batches([len(dataset[i]["input_ids"]) for i in indices], recipe.capture.batch_tokens)
    padded = [capture.pad_batch(dataset[b]["input_ids"]) for b in batches]
    num_tokens = sum(int(m.sum()) for _, m in padded)
    with torch.no_grad():
        model(*padded[0])  # warm-up
        start = time.perf_counter()
        for ids, mask in padded:
            model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device))
        plain = time.perf_counter() - start
    results = {"num_tokens": num_tokens, "plain_tokens_per_s": num_tokens / plain, "hidden_size": cfg.hidden_size}
    for name, layout in LAYOUTS.items():
        spec = capture.make_spec(recipe_mod.load(recipe_path, overrides + layout), cfg.num_hidden_layers,
                                 cfg.hidden_size, data_manifest, capture_needs(recipe.head.kind))
        extractor = FeatureExtractor(model, spec.stored_layer_ids, stop_after_features=spec.recompute)
        with tempfile.TemporaryDirectory() as tmp:
            writer = capture.ShardWriter(Path(tmp), 0, int(recipe.capture.shard_size_mb * 2**20), 0, spec.compression)
            start = time.perf_counter()
            for batch in batches:
                records, _ = capture.batch_records(extractor, dataset[batch], spec.dtype)
                for index, record in zip(batch, records):
                    writer.add(index, record)
            writer.flush()
            seconds = time.perf_counter() - start
            written = sum(p.stat().st_size for p in Path(tmp).glob("shard-*"))
        extractor.remove()
        results[name] = {"tokens_per_s": num_tokens / seconds, "ratio_vs_plain_forward": plain / seconds,
                         "bytes_per_token": written / num_tokens,
                         "ratio_vs_specforge": written / num_tokens / (4 * cfg.hidden_size * 2)}
    return results


def bench_train_k(recipe_path: str, overrides: list[str], k: int, steps: int) -> dict:
    """One training run in a fresh process per k, so peak RSS belongs to that run alone."""
    code = ("import json,resource,sys,time,torch; from draftsmith import recipe as R; from draftsmith.train.run import build_trainer;"
            f"r=R.load({recipe_path!r}, {overrides!r} + ['head.ttt_steps={k}','train.max_steps={steps}']);"
            "t=build_trainer(r); it=t.micro_batches(); t.train_step(next(it)); s=time.perf_counter(); n0=t.tokens;"
            f"[t.train_step(next(it)) for _ in range({steps})]; dt=time.perf_counter()-s;"
            "mem=torch.cuda.max_memory_allocated()/2**30 if torch.cuda.is_available() else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/2**20;"
            "print(json.dumps({'tokens_per_s':(t.tokens-n0)/dt,'peak_memory_gb':mem}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_layouts(recipe_path: str, overrides: list[str], steps: int) -> dict:
    """Train the same head on each store layout (same data, steps, seed): held-out simulated
    acceptance (fp8's effect) and training tokens/s (the cost of rebuilding features at train time)."""
    from draftsmith.data.capture import run_capture
    from draftsmith.heads.registry import capture_needs
    from draftsmith.train.run import build_trainer
    out = {}
    for name, layout in LAYOUTS.items():
        recipe = recipe_mod.load(recipe_path, overrides + layout + [f"train.max_steps={steps}", f"name=bench-{name}",
                                                                    "train.save_every=100000", "train.eval_every=100000"])
        link_data(recipe, recipe_mod.load(recipe_path, overrides))
        run_capture(recipe, capture_needs(recipe.head.kind))
        trainer = build_trainer(recipe)
        start = time.perf_counter()
        final = trainer.run()
        seconds = time.perf_counter() - start
        out[name] = {"eval_sim_accept_len": final.get("eval_sim_accept_len"), "eval_acc_0": final.get("eval_acc_0"),
                     "train_tokens_per_s": trainer.tokens / seconds}
    return out



def render_pipeline(r: dict) -> list[str]:
    cap, rt = r["capture"], r["runtime"]
    lines = ["## Hidden-state capture (issue #3)", "",
             "Layouts: *full* keeps the three EAGLE-3 features at every position read and the teacher state at loss "
             "positions, uncompressed; *compact* (the default: `capture.recompute: true`, `capture.compression: zstd`) "
             "keeps the mid and high features only, losslessly compressed, and the trainer rebuilds the low feature "
             "and the teacher with the target's first and last layers.", "",
             "| | tokens/s | vs plain forward | bytes/token | vs SpecForge (4·H bf16) |", "|---|---|---|---|---|",
             f"| plain target forward (logits) | {cap['plain_tokens_per_s']:.0f} | 1.00x | | |"]
    for name in LAYOUTS:
        c = cap[name]
        lines.append(f"| capture, {name} store | {c['tokens_per_s']:.0f} | {c['ratio_vs_plain_forward']:.2f}x | "
                     f"{c['bytes_per_token']:.0f} | {c['ratio_vs_specforge']:.2f}x |")
    lay = r["layouts"]
    lines += ["", "Goals: capture >= 0.9x of a plain forward; <= 0.5x SpecForge's bytes without fp8, <= 0.25x with fp8.", "",
              f"The same head trained {r.get('layout_steps', 300)} steps on each store (held-out simulated acceptance "
              "length, first-token accuracy, training tokens/s with TTT k from the recipe):", "",
              "| store | acceptance length | acc_0 | training tokens/s |", "|---|---|---|---|"]
    for name in LAYOUTS:
        t = lay[name]
        lines.append(f"| {name} | {t['eval_sim_accept_len']:.3f} | {t['eval_acc_0']:.3f} | {t['train_tokens_per_s']:.0f} |")
    lines += ["",
              "## Training (issue #4)", "", "| TTT steps k | tokens/s | peak memory (GB) |", "|---|---|---|"]
    for k, t in r["train"].items():
        lines.append(f"| {k} | {t['tokens_per_s']:.0f} | {t['peak_memory_gb']:.2f} |")
    lines += ["", "Peak memory is the process's peak RSS on CPU (model, data and Python included), CUDA max allocated on GPU. "
              "The recipe's store is read as configured (compact by default), so these include rebuilding the low "
              "feature and the teacher at train time.", "",
              "## Runtime (issue #5)", "",
              f"Held-out prompts: {rt['num_prompts']}, up to {rt['max_new_tokens']} new tokens, temperature 0, "
              f"tree {rt['tree']}, {rt['device']} {rt['dtype']}. Wall-clock ratios vary by about 5% between runs on this machine.", "",
              "| metric | value | goal |", "|---|---|---|",
              f"| tau (tokens per target forward, bonus included) | {rt['tau']:.2f} | >= 2.5 |",
              f"| speculative vs plain decoding (same runtime) | {rt['speedup_vs_plain']:.2f}x | >= 1.5x |",
              f"| speculative vs HF generate | {rt['speedup_vs_hf_generate']:.2f}x | >= 2x |",
              f"| plain / speculative / HF generate tokens/s | {rt['plain_tokens_per_s']:.0f} / {rt['spec_tokens_per_s']:.0f} / "
              f"{rt['hf_generate_tokens_per_s']:.0f} | |",
              f"| draft/target step cost c; tau/(gamma c + 1) | {rt['draft_to_target_cost_c']:.3f}; {rt['expected_walltime_factor']:.2f} | |",
              f"| greedy output identical to plain greedy | {rt['num_exact']}/{rt['num_prompts']} | all |",
              f"| acceptance per depth (conditional) | {', '.join(f'{a:.2f}' for a in rt['acceptance_per_depth'])} | |", ""]
    return lines
