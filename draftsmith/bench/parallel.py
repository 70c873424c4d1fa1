"""`make bench` section `parallel`: capture and validation throughput of the demo target at tp 1 (one
process) and tp 2 (two processes under torchrun, gloo on CPU), so the cost of the collectives shows as a
ratio. Each launch runs `python -m draftsmith.bench.parallel OUT RECIPE key=value...`: the capture
path (FeatureExtractor over the demo's batches) and greedy speculative decoding in the runtime, timed
after one warm-up; rank 0 writes the figures."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _capture_tokens_per_s(recipe, model, num_samples: int = 128) -> float:
    from draftsmith.data import capture
    from draftsmith.data.prepare import load_train
    from draftsmith.heads.registry import capture_needs
    from draftsmith.targets.features import FeatureExtractor
    dataset, _ = load_train(recipe)
    ids = capture.layer_ids_for(recipe, model.config.get_text_config().num_hidden_layers, capture_needs(recipe.head.kind))
    extractor = FeatureExtractor(model, ids)
    indices = list(range(min(num_samples, len(dataset))))
    batches = capture.plan_batches([len(dataset[i]["input_ids"]) for i in indices], recipe.capture.batch_tokens)
    padded = [capture.pad_batch(dataset[b]["input_ids"]) for b in batches]
    extractor(*padded[0])
    start = time.perf_counter()
    for input_ids, mask in padded:
        extractor(input_ids, mask)
    return sum(int(m.sum()) for _, m in padded) / (time.perf_counter() - start)


def _decode_tokens_per_s(recipe, model, draft_head, tokenizer) -> dict:
    from draftsmith.heads.drafting import TreeConfig
    from draftsmith.heads.registry import head_spec
    from draftsmith.runtime.generate import plain_generate, speculative_generate
    from draftsmith.runtime.target import TargetRunner
    from draftsmith.runtime.loading import eos_ids, validation_prompts
    from draftsmith.runtime.verify import SamplingConfig
    cfg = recipe.validate
    prompts = [p for p, _, _ in validation_prompts(recipe, tokenizer, 8)]
    max_len = max(len(p) for p in prompts) + cfg.max_new_tokens + cfg.num_nodes + 8
    runner = TargetRunner(model, max_len, draft_head.config.get("draftsmith", {}).get("layer_ids", []), compile_mode=None)
    drafter = head_spec(draft_head.kind).drafter(draft_head, max_len, TreeConfig(cfg.depth, cfg.top_k, cfg.num_nodes))
    eos, greedy = eos_ids(model, tokenizer), SamplingConfig()
    speculative_generate(runner, drafter, prompts[0], 8, greedy, eos)
    out = {"plain_tokens": 0, "plain_s": 0.0, "spec_tokens": 0, "spec_s": 0.0, "outputs": []}
    for prompt in prompts:
        plain = plain_generate(runner, prompt, cfg.max_new_tokens, greedy, eos)
        spec = speculative_generate(runner, drafter, prompt, cfg.max_new_tokens, greedy, eos)
        out["plain_tokens"] += len(plain.tokens)
        out["plain_s"] += plain.seconds
        out["spec_tokens"] += len(spec.tokens)
        out["spec_s"] += spec.seconds
        out["outputs"].append(spec.tokens)
    return out


def worker(out: str, recipe_path: str, *overrides: str) -> None:
    from draftsmith import recipe as recipe_mod
    from draftsmith.runtime.loading import load_target_and_head
    from draftsmith.targets import parallel
    recipe = recipe_mod.load(recipe_path, list(overrides))
    model, tokenizer, draft_head, _, _ = load_target_and_head(recipe, None)
    result = {"capture_tokens_per_s": _capture_tokens_per_s(recipe, model)} | _decode_tokens_per_s(recipe, model, draft_head, tokenizer)
    if parallel.is_first_rank():
        Path(out).write_text(json.dumps(result))


def _launch(tp: int, recipe_path: str, overrides: list[str], out: Path) -> dict:
    env = os.environ | {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // tp))}
    head = [sys.executable] if tp == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"]
    cmd = head + ["-m", "draftsmith.bench.parallel", str(out), recipe_path, *overrides, f"target.parallel.tp={tp}"]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=3600)
    return json.loads(out.read_text())


def bench_parallel(recipe_path: str, overrides: list[str]) -> dict:
    """tp 1 and tp 2 on the same weights, prompts and batches; every thread count is the machine's cores
    split over the processes, so both runs use the same CPU."""
    scratch = Path(tempfile.mkdtemp(prefix="draftsmith-bench-parallel-"))
    rows = {str(tp): _launch(tp, recipe_path, overrides, scratch / f"tp{tp}.json") for tp in (1, 2)}
    out = {}
    for tp, r in rows.items():
        out[tp] = {"capture_tokens_per_s": r["capture_tokens_per_s"], "plain_tokens_per_s": r["plain_tokens"] / r["plain_s"],
                   "spec_tokens_per_s": r["spec_tokens"] / r["spec_s"]}
    out["identical_outputs"] = rows["1"]["outputs"] == rows["2"]["outputs"]
    out["ratios"] = {k: out["2"][k] / out["1"][k] for k in out["1"]}
    print(f"[bench] parallel: tp 2 / tp 1 {out['ratios']}", flush=True)
    return out


def render_parallel(r: dict) -> list[str]:
    p = r.get("parallel")
    if not p:
        return []
    lines = ["## Sharded targets on CPU (issue #20)", "",
             f"The demo target at tp 1 (one process) and tp 2 (two processes, torchrun, gloo), "
             f"{r.get('measured', {}).get('parallel', r['date'])}; both runs share the machine's 2 cores (one thread per "
             "process at tp 2). Capture: the feature extractor over the demo's first 128 samples in "
             "`capture.batch_tokens` batches; decoding: 8 held-out prompts, the validation settings, greedy.", "",
             "| | tp 1 | tp 2 | tp 2 / tp 1 |", "|---|---|---|---|"]
    for key, label in (("capture_tokens_per_s", "capture tokens/s"), ("plain_tokens_per_s", "plain decoding tokens/s"),
                       ("spec_tokens_per_s", "speculative decoding tokens/s")):
        lines.append(f"| {label} | {p['1'][key]:.0f} | {p['2'][key]:.0f} | {p['ratios'][key]:.2f}x |")
    return lines + ["", f"Speculative outputs identical at tp 1 and tp 2: {p['identical_outputs']}. On one CPU the two "
                    "processes split the same cores, so the ratio is the cost of the collectives (an all-reduce per "
                    "attention and MLP block, an all-gather of the logits) over a target this small; on GPUs each rank "
                    "brings its own device and memory bandwidth.", ""]


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    worker(*sys.argv[1:])
