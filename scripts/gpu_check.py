"""The CUDA check: run on a machine with a GPU (`make gpu-check`). It exercises the paths the CPU
suite cannot: bf16 target + head on CUDA, fp32 exactness on CUDA, bf16 match rate, a bf16
training step, capture on the GPU, and timings. Prints one JSON summary; exits non-zero on failure."""
import json
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.heads.drafting import TreeConfig
from draftsmith.heads.eagle3.draft import Eagle3Drafter
from draftsmith.heads.eagle3.model import Eagle3Head, draft_config_from_target
from draftsmith.runtime.compile import step_compiler
from draftsmith.runtime.generate import plain_generate, speculative_generate
from draftsmith.runtime.target import TargetRunner
from draftsmith.runtime.verify import SamplingConfig
from draftsmith.targets.features import FeatureExtractor


def build(dtype, device="cuda"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to(device, dtype).eval()
    ids = [2, 6, 9]
    head = Eagle3Head(draft_config_from_target(config, 8000, ids)).to(device, dtype).eval()
    t2d = torch.zeros(32000, dtype=torch.bool, device=device)
    t2d[:8000] = True
    head.set_vocab(torch.zeros(8000, dtype=torch.long, device=device), t2d)
    head.load_target_weights(model.get_input_embeddings().weight)
    return model, head, ids


def check_eagle2() -> dict:
    """EAGLE-2 on CUDA (fp32, CUDA graphs): the family-layer head fed the final hidden state."""
    from draftsmith.heads.eagle2.draft import Eagle2Drafter
    from draftsmith.heads.eagle2.model import Eagle2Head, draft_config_from_target as eagle2_config
    model, _, _ = build(torch.float32)
    head = Eagle2Head(eagle2_config(model.config)).to("cuda").eval()
    head.load_target_weights(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    runner = TargetRunner(model, 1024, [])
    drafter = Eagle2Drafter(head, 1024, TreeConfig(5, 8, 40), step_compiler("auto", torch.device("cuda")))
    same = 0
    for seed in range(4):
        prompt = torch.randint(0, 32000, (64,), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        same += plain_generate(runner, prompt, 96, SamplingConfig(), set()).tokens == \
            speculative_generate(runner, drafter, prompt, 96, SamplingConfig(), set()).tokens
    return {"identical": same == 4, "identical_prompts": f"{same}/4"}


def check_sweep(device: str = "cuda", batch_sizes=(1, 8, 32), ks=(2, 4)) -> dict:
    """The economics sweep, briefly (`draftsmith economics` on a random target: acceptance is near zero,
    so this checks batched exactness per row and measures how plain and verify forwards scale with load)."""
    from draftsmith.runtime import economics as econ
    from draftsmith.runtime.baselines import NgramDrafter, chain_config
    from draftsmith.runtime.sweep import Sweep, summarize
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, head, ids = build(dtype, device)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).to(device) for n in (16, 40, 64, 100, 23, 77, 9, 50)]
    factories = {"eagle3": lambda k: Eagle3Drafter(head, 512, chain_config(k)), "ngram": lambda k: NgramDrafter(k)}
    sweep = Sweep(model, ids, prompts, ["random"] * len(prompts), set(), 32, 512, torch.device(device))
    grid = {b: sweep.run_batch(b, factories, {name: list(ks) for name in factories}) for b in batch_sizes}
    plain = {b: grid[b]["plain"] for b in grid}
    out = {"plain_tokens_per_s": {b: round(plain[b]["tokens_per_s"]) for b in grid}}
    for name in factories:
        cells = {b: grid[b][name] for b in grid}
        summary = summarize(name, cells, plain, 0.1, 2.0, 0.0)
        out[name] = {"schedule": summary["schedule"], "exact_rows": f"{summary['exact_rows']}/{summary['rows']}",
                     "tokens_per_s": {b: {k: round(c["tokens_per_s"]) for k, c in cells[b].items()} for b in cells}}
        if summary["exact_rows"] != summary["rows"] and dtype == torch.float32:
            out["error"] = f"batched {name} rows differ from plain batched decoding"
    out["schedule_check"] = econ.schedule({b: {0: 1.0} for b in grid}) == [[min(grid), max(grid), 0]]
    return out


def _greedy_and_features(model, ids) -> dict:
    """Greedy decoding of two prompts in the runtime and the capture features of one batch (the tp check's figures)."""
    runner = TargetRunner(model, 256, ids, compile_mode=None)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32000, (n,), generator=gen).to("cuda") for n in (32, 48)]
    tokens = [plain_generate(runner, p, 32, SamplingConfig(), set()).tokens for p in prompts]
    aux, _ = FeatureExtractor(model, ids)(torch.stack([prompts[0], prompts[1][:32]]))
    return {"tokens": tokens, "aux": aux.float().cpu()}


def tp_worker(model_dir: str, out: str) -> None:
    """Run under torchrun, one process per GPU: the saved fp32 target sharded with target.parallel's layout."""
    import os
    from transformers import AutoModelForCausalLM
    from draftsmith.targets import parallel
    parallel.init_process_group()
    world, rank = parallel.world_and_rank()
    layout = parallel.Layout(tp=world, world=world, rank=rank)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, distributed_config=layout.distributed_config()).eval()
    result = _greedy_and_features(model, [2, 6, 9])
    if rank == 0:
        torch.save(result, out)
    torch.distributed.barrier()
    os._exit(0)


def check_tensor_parallel() -> dict:
    """With several GPUs: the target sharded tp = (GPUs, at most its 4 KV heads) ways by transformers
    against the same target on one GPU: identical greedy tokens, features within fp32 rounding."""
    import subprocess
    import tempfile
    tp = max(t for t in (1, 2, 4) if t <= torch.cuda.device_count())
    if tp < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU: tensor parallelism needs two or more"}
    model, _, ids = build(torch.float32)
    work = Path(tempfile.mkdtemp(prefix="draftsmith-tp-"))
    model.save_pretrained(work / "target")
    reference = _greedy_and_features(model, ids)
    del model
    torch.cuda.empty_cache()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", __file__,
                    "--tp-worker", str(work / "target"), str(work / "tp.pt")], check=True, timeout=1800)
    sharded = torch.load(work / "tp.pt")
    err = float((sharded["aux"] - reference["aux"]).norm() / reference["aux"].norm())
    return {"tp": tp, "identical_tokens": sharded["tokens"] == reference["tokens"], "feature_rel_err": err,
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    out = {"device": torch.cuda.get_device_name(0)}
    for dtype in (torch.float32, torch.bfloat16):
        model, head, ids = build(dtype)
        runner, drafter = TargetRunner(model, 1024, ids), Eagle3Drafter(head, 1024, TreeConfig(6, 8, 48),
                                                                   step_compiler("auto", torch.device("cuda")))
        same, t_plain, t_spec = 0, 0.0, 0.0
        for seed in range(8):
            prompt = torch.randint(0, 32000, (64,), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
            a = plain_generate(runner, prompt, 128, SamplingConfig(), set())
            b = speculative_generate(runner, drafter, prompt, 128, SamplingConfig(), set())
            same += a.tokens == b.tokens
            t_plain, t_spec = t_plain + a.seconds, t_spec + b.seconds
        out[str(dtype)] = {"identical_prompts": f"{same}/8", "plain_s": round(t_plain, 3), "spec_s": round(t_spec, 3)}
        if dtype == torch.float32 and same != 8:
            out["error"] = "fp32 greedy speculative output differs from plain greedy on CUDA"
    out["eagle2_fp32"] = check_eagle2()
    if not out["eagle2_fp32"]["identical"]:
        out["error"] = "fp32 greedy EAGLE-2 speculative output differs from plain greedy on CUDA"
    out["economics_sweep"] = check_sweep()
    if "error" in out["economics_sweep"]:
        out["error"] = out["economics_sweep"]["error"]
    out["tensor_parallel"] = check_tensor_parallel()
    if out["tensor_parallel"].get("identical_tokens") is False or out["tensor_parallel"].get("feature_rel_err", 0) > 1e-4:
        out["error"] = "the tensor-parallel target differs from the one-GPU target"
    model, head, ids = build(torch.float32)
    head.train()
    extractor = FeatureExtractor(model, ids)
    x = torch.randint(0, 32000, (2, 512), device="cuda")
    start = time.perf_counter()
    aux, final = extractor(x)
    torch.cuda.synchronize()
    out["capture_ms"] = round((time.perf_counter() - start) * 1e3, 1)
    probs = torch.softmax(torch.randn(2, 512, 8000, device="cuda"), -1)
    batch = {"input_ids": x, "position_ids": torch.arange(512, device="cuda").expand(2, 512), "aux": aux,
             "target_probs": probs, "target_valid": torch.ones(2, 512, dtype=torch.bool, device="cuda"),
             "target_argmax": probs.argmax(-1)}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, metrics = head(batch)
    loss.backward()
    out["train_step_loss"] = float(loss)
    out["max_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(out, indent=2))
    return 1 if "error" in out or not torch.isfinite(loss) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tp-worker"]:
        tp_worker(*sys.argv[2:4])
    sys.exit(main())
