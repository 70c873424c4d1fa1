"""`draftsmith validate`: prove a head in the bundled runtime before it is exported.

Writes validation.json, report.md and plots: tau (tokens per target forward, bonus included),
conditional acceptance per depth, the acceptance-length histogram, tokens/s of plain decoding
and of speculative decoding in this runtime, Hugging Face `generate` as an outside baseline,
the token-for-token comparison with plain greedy decoding, the measured draft/target step cost
ratio c and the expected walltime factor tau / (gamma * c + 1)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith import artifacts
from draftsmith.recipe import Recipe
from draftsmith.runtime.economics import depth_speedups, low_batch_screen
from draftsmith.runtime.generate import acceptance_stats, output_digest, plain_generate, speculative_generate
from draftsmith.runtime.loading import (
    eos_ids, head_sha, load_target_and_head, non_finite_tensors, prompt_image_inputs, validation_drafter,
    validation_max_len, validation_prompts)
from draftsmith.runtime.target import TargetRunner
from draftsmith.runtime.timing import draft_step_cost, verify_costs
from draftsmith.runtime.verify import SamplingConfig
from draftsmith.targets.parallel import is_first_rank


def validate_dir(recipe: Recipe) -> Path:
    return recipe.run_dir / "validate"


def validation_is_current(recipe: Recipe) -> bool:
    path = validate_dir(recipe) / "validation.json"
    if not path.exists():
        return False
    data = json.loads(path.read_text())
    head = recipe.run_dir / "head"
    return data.get("head_sha256") == head_sha(head) and data.get("validate_hash") == recipe.section_hash("validate")


LENGTH_BUCKETS = (128, 512, 2048, 8192, 32768)  # input-length and position buckets (tokens) of the low-batch screen


def run_validate(recipe: Recipe | None, head: str | None = None, target: str | None = None, out: str | None = None) -> dict:
    if recipe is None:
        raise ValueError("validate needs --recipe (for the held-out prompts and decoding settings)")
    if target:
        recipe.target.model = target
    from draftsmith.targets import parallel
    cfg = recipe.validate
    model, tokenizer, draft_head, meta, head_path = load_target_and_head(recipe, head)
    device = model.device
    eos = eos_ids(model, tokenizer)
    chosen = validation_prompts(recipe, tokenizer, cfg.num_prompts + cfg.num_calibration_prompts)
    heldout = [p.to(device) for p, _, _ in chosen]
    domains = [d for _, d, _ in chosen][:cfg.num_prompts]
    image_inputs = [prompt_image_inputs(tokenizer, p, sources, model) for p, _, sources in chosen][:cfg.num_prompts]
    prompts, calibration_prompts = heldout[:cfg.num_prompts], heldout[cfg.num_prompts:] or heldout[:cfg.num_prompts]
    max_len = validation_max_len(recipe, heldout)
    layer_ids = draft_head.config.get("draftsmith", {}).get("layer_ids", [])
    drift = None
    if draft_head.config.get("draftsmith", {}).get("joint"):  # trained jointly with the target: it runs on the fine-tuned one
        from draftsmith.runtime.drift import measure_drift
        model, drift = measure_drift(recipe, model, head_path / "lora", prompts, eos, tokenizer)
    runner = TargetRunner(model, max_len, layer_ids)
    if runner.recurrent and (cfg.top_k != 1 or cfg.tree_choices):
        raise ValueError(f"validate.top_k is {cfg.top_k}{' with validate.tree_choices' if cfg.tree_choices else ''}, but "
                         f"{model.config.model_type} has recurrent layers, which advance over one chain: set validate.top_k: 1 "
                         "(and no tree_choices) for this target")
    drafter = validation_drafter(recipe, draft_head, max_len, device)
    calibration = None
    if hasattr(drafter, "calibrate") and cfg.tree_choices is None:
        calibration = _calibrate(drafter, runner, calibration_prompts, cfg.max_new_tokens, eos)
        calibration["prompts"] = "separate held-out prompts" if len(heldout) > cfg.num_prompts else "the measured prompts (too few held out)"
    result = _measure(recipe, model, runner, drafter, prompts, eos, domains, image_inputs)
    if calibration:
        result["calibration"] = calibration
    if drift:
        result["drift"] = drift
    result.update(head=str(head_path), head_sha256=head_sha(head_path), head_format=meta.get("source_format"),
                  target=recipe.target.model, device=str(device), dtype=str(model.dtype),
                  validate_hash=recipe.section_hash("validate"), tree=vars(drafter.tree_cfg),
                  training=meta.get("final_metrics"), layer_ids=layer_ids, kind=draft_head.kind)
    result["non_finite_tensors"] = non_finite_tensors(draft_head)
    # in fp32 both references must agree token for token; in bf16/fp16 HF's dynamic cache and ours may round
    # differently, so the comparison with `generate` is reported there, not gating
    gate_generate = result["exact_vs_generate"] or model.dtype != torch.float32
    result["passed"] = bool(result["exact_match"] and gate_generate and not result["non_finite_tensors"]
                            and (cfg.min_tau is None or result["tau"] >= cfg.min_tau))
    result["warnings"] = _warnings(result)
    for warning in result["warnings"]:
        print(f"[draftsmith] validate: WARNING: {warning}", flush=True)
    out_dir = Path(out) if out else validate_dir(recipe)
    if parallel.is_first_rank():  # every rank of a sharded target ran the same decoding; one writes
        write_report(out_dir, result)
    return {k: result[k] for k in ("tau", "speedup_vs_plain", "speedup_vs_hf_generate", "exact_match", "passed")} | {
        "report": str(out_dir / "report.md")}


def _warnings(result: dict) -> list[str]:
    """What a passing head can still get wrong: it is exact, but does it pay on this device?"""
    out = []
    if result["speedup_vs_plain"] < 1:
        out.append(f"the head is SLOWER than plain decoding on {result['device']}: {result['speedup_vs_plain']:.2f}x "
                   f"(tau {result['tau']:.2f}, draft cost c {result['draft_to_target_cost_c']:.3f}); try a shorter chain "
                   "(validate.depth) or a narrower tree, or a GPU, where a verify forward costs about one decode step")
    choice = result.get("depth_choice")
    if choice and choice["best_depth"] == 0:
        out.append(f"no chain depth pays on {result['device']}: verifying n tokens costs "
                   f"{', '.join(f'{v:.2f}' for v in choice['verify_cost_by_tokens'][:4])} ... decode steps for n = 1, 2, 3, 4, "
                   "more than the accepted tokens return")
    elif choice and choice["best_predicted_speedup"] > 1.05 * choice["predicted_speedup_by_depth"][len(result["acceptance_per_depth"])]:
        out.append(f"depth {choice['best_depth']} pays best on {result['device']} (predicted "
                   f"{choice['best_predicted_speedup']:.2f}x): set validate.depth: {choice['best_depth']}")
    slow = [d for d, s in result.get("per_domain", {}).items() if s.get("speedup_vs_plain", 1) < 1]
    if slow and len(result.get("per_domain", {})) > 1:
        out.append(f"slower than plain decoding on the prompts of {', '.join(slow)}")
    return out


def _calibrate(drafter, runner, prompts, max_new_tokens: int, eos) -> dict:
    """The target's own greedy continuations of held-out prompts, for drafters that shape their
    tree from measured accuracies (Medusa)."""
    sequences = []
    for prompt in prompts:
        out = plain_generate(runner, prompt, max_new_tokens, SamplingConfig(), eos)
        sequences.append((torch.cat([prompt, torch.tensor(out.tokens, device=prompt.device)]), len(prompt)))

    def features_of(tokens):
        runner.reset()
        return runner.prefill(tokens)[1]
    return drafter.calibrate(sequences, features_of)


def _grouped(accepts: list[list[int]], keys: list[str], depth: int) -> dict:
    """tau, alpha per depth and the i.i.d. alpha per group of prompts (a domain, an input-length bucket)."""
    from draftsmith.runtime.economics import alpha_from_tau
    out = {}
    for key in sorted(set(keys)):
        stats = acceptance_stats([a for acc, k in zip(accepts, keys) if k == key for a in acc], depth)
        out[key] = {"num_prompts": keys.count(key), "tau": stats["tau"], "alpha_iid": alpha_from_tau(stats["tau"], depth),
                    "acceptance_per_depth": stats["acceptance_per_depth"]}
    return out


def _depth_choice(runner, prompt, acceptance_per_depth: list[float], c: float, depth: int) -> dict:
    """The chain depth that pays on this device: the verify cost measured by the number of tokens verified,
    the predicted speedup of each depth from the measured acceptance, and the best (0: none pays)."""
    costs = verify_costs(runner, prompt, depth + 1)
    predicted = depth_speedups(acceptance_per_depth, c, costs)
    best = max(predicted, key=predicted.get)
    return {"verify_cost_by_tokens": costs, "predicted_speedup_by_depth": predicted, "best_depth": best,
            "best_predicted_speedup": predicted[best]}


def _speedups(timings: list[tuple], keys: list[str]) -> dict:
    """Per group of prompts: speculative tokens/s over plain decoding's and over HF `generate`'s, from
    (plain tokens, s, speculative tokens, s, generate tokens, s) per prompt."""
    out = {}
    for key in sorted(set(keys)):
        rows = [t for t, k in zip(timings, keys) if k == key]
        plain, spec, hf = (sum(r[i] for r in rows) / max(sum(r[i + 1] for r in rows), 1e-9) for i in (0, 2, 4))
        out[key] = {"spec_tokens_per_s": spec, "speedup_vs_plain": spec / max(plain, 1e-9),
                    "speedup_vs_hf_generate": spec / max(hf, 1e-9)}
    return out


def _length_bucket(length: int) -> str:
    low = 0
    for edge in LENGTH_BUCKETS:
        if length < edge:
            return f"{low}-{edge - 1}"
        low = edge
    return f">={low}"


def _by_position(per_prompt: list[list[int]], prompts, depth: int) -> dict:
    """tau and acceptance per bucket of the position (context length) at which each round drafted: a head
    trained on short samples loses acceptance deep into a long context, whatever the prompt's length."""
    rounds: dict[str, list[int]] = {}
    for accepts, prompt in zip(per_prompt, prompts):
        position = len(prompt)
        for accepted in accepts:
            rounds.setdefault(_length_bucket(position), []).append(accepted)
            position += accepted + 1
    return {key: {k: v for k, v in acceptance_stats(values, depth).items() if k != "accept_length_histogram"}
            for key, values in sorted(rounds.items(), key=lambda kv: int(kv[0].lstrip(">=").split("-")[0]))}


@torch.no_grad()
def generate_reference(model, prompt: torch.Tensor, max_new_tokens: int, eos: set[int],
                       image_inputs: dict | None = None) -> tuple[list[int], float]:
    """The model's own greedy `generate` (its dynamic cache, its masks, an image prompt's pixel inputs): the
    reference speculative output must equal, so that an error shared by our runtime's plain and speculative paths
    cannot pass; and its seconds, the HF `generate` speed the report compares with."""
    ids = prompt[None].to(model.device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         **(image_inputs or {}),
                         eos_token_id=sorted(eos) or None, pad_token_id=model.generation_config.pad_token_id or 0,
                         top_p=None, top_k=None, temperature=None)
    seconds = time.perf_counter() - start
    tokens = out[0, ids.shape[1]:].tolist()
    ends = [i for i, token in enumerate(tokens) if token in eos]
    return (tokens[:ends[0] + 1] if ends else tokens), seconds


def _measure(recipe: Recipe, model, runner, drafter, prompts, eos, domains: list[str] | None = None,
             image_inputs: list[dict | None] | None = None) -> dict:
    cfg = recipe.validate
    greedy = SamplingConfig()
    plain_generate(runner, prompts[0], 8, greedy, eos)          # warm-up: allocator, kernels
    speculative_generate(runner, drafter, prompts[0], 8, greedy, eos)
    plain_s = spec_s = hf_s = 0.0
    plain_tokens = spec_tokens = hf_tokens = 0
    accept, exact, mismatches, per_prompt, timings, digests = [], 0, [], [], [], []
    exact_generate, mismatches_generate = 0, []
    bar = tqdm(prompts, desc="validate", unit="prompt", mininterval=2.0, disable=not is_first_rank())
    image_inputs = image_inputs or [None] * len(prompts)
    for i, prompt in enumerate(bar):
        base = plain_generate(runner, prompt, cfg.max_new_tokens, greedy, eos, image_inputs=image_inputs[i])
        spec = speculative_generate(runner, drafter, prompt, cfg.max_new_tokens, greedy, eos, image_inputs=image_inputs[i])
        reference, seconds = generate_reference(model, prompt, cfg.max_new_tokens, eos, image_inputs[i])
        hf_s += seconds
        plain_s, spec_s = plain_s + base.seconds, spec_s + spec.seconds
        plain_tokens, spec_tokens, hf_tokens = plain_tokens + len(base.tokens), spec_tokens + len(spec.tokens), hf_tokens + len(reference)
        accept += spec.accept_lengths
        per_prompt.append(spec.accept_lengths)
        digests.append(output_digest(spec.tokens))
        timings.append((len(base.tokens), base.seconds, len(spec.tokens), spec.seconds, len(reference), seconds))
        if base.tokens == spec.tokens:
            exact += 1
        else:
            mismatches.append(i)
        if reference == spec.tokens:
            exact_generate += 1
        else:
            mismatches_generate.append(i)
        bar.set_postfix(spec_tok_s=f"{spec_tokens / spec_s:.1f}", plain_tok_s=f"{plain_tokens / plain_s:.1f}",
                        tau=f"{sum(a + 1 for a in accept) / max(len(accept), 1):.2f}", exact=f"{exact}/{i + 1}")
    bar.close()
    stats = acceptance_stats(accept, cfg.depth)
    c = draft_step_cost(drafter, runner, prompts[0])
    result = {**stats, "num_prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens,
              "exact_match": exact == len(prompts), "num_exact": exact, "mismatched_prompts": mismatches,
              "exact_vs_generate": exact_generate == len(prompts), "num_exact_vs_generate": exact_generate,
              "mismatched_prompts_vs_generate": mismatches_generate, "output_sha256": digests,
              "plain_tokens_per_s": plain_tokens / plain_s, "spec_tokens_per_s": spec_tokens / spec_s,
              "hf_generate_tokens_per_s": hf_tokens / hf_s, "draft_to_target_cost_c": c,
              "expected_walltime_factor": stats["tau"] / (cfg.depth * c + 1)}
    result["speedup_vs_plain"] = result["spec_tokens_per_s"] / result["plain_tokens_per_s"]
    result["speedup_vs_hf_generate"] = result["spec_tokens_per_s"] / result["hf_generate_tokens_per_s"]
    # the low-batch screen: Theorem 3.8's prediction next to the measurement, and the break-even c*
    result["screen"] = low_batch_screen(stats["tau"], cfg.depth, c, result["speedup_vs_plain"], stats["acceptance_per_depth"])
    domains = domains or ["heldout"] * len(prompts)
    result["screen"]["per_domain"] = _grouped(per_prompt, domains, cfg.depth)
    for domain, speeds in _speedups(timings, domains).items():
        result["screen"]["per_domain"][domain].update(speeds)
    result["per_domain"] = result["screen"]["per_domain"]
    if cfg.top_k == 1 and not cfg.tree_choices:  # a chain: each depth's cost is known (a tree verifies num_nodes)
        result["depth_choice"] = _depth_choice(runner, prompts[0], stats["acceptance_per_depth"], c, cfg.depth)
    result["screen"]["per_input_length"] = _grouped(per_prompt, [_length_bucket(len(p)) for p in prompts], cfg.depth)
    result["screen"]["per_position"] = _by_position(per_prompt, prompts, cfg.depth)
    if cfg.temperature > 0:
        sampled = SamplingConfig(cfg.temperature, cfg.sample_top_k, cfg.top_p)
        gen = torch.Generator(device=prompts[0].device).manual_seed(recipe.seed)
        runs = [speculative_generate(runner, drafter, p, cfg.max_new_tokens, sampled, eos, gen, x)
                for p, x in zip(prompts, image_inputs)]
        result["sampled"] = {"temperature": cfg.temperature, "lossless": True,
                             **acceptance_stats([a for r in runs for a in r.accept_lengths], cfg.depth)}
        if cfg.typical_acceptance:
            typical = SamplingConfig(cfg.temperature, cfg.sample_top_k, cfg.top_p, "typical", cfg.posterior_threshold, cfg.posterior_alpha)
            runs = [speculative_generate(runner, drafter, p, cfg.max_new_tokens, typical, eos, gen) for p in prompts]
            tokens = sum(len(r.tokens) for r in runs)
            result["typical_acceptance"] = {
                "lossless": False, "note": "Medusa's typical acceptance: output does NOT follow the target distribution; "
                "reported for comparison, never used for pass/fail", "posterior_threshold": cfg.posterior_threshold,
                "posterior_alpha": cfg.posterior_alpha, "tokens_per_s": tokens / sum(r.seconds for r in runs),
                **acceptance_stats([a for r in runs for a in r.accept_lengths], cfg.depth)}
    return result


RED = '<span style="color:red">**{}**</span>'


def write_report(out_dir: Path, result: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    hist = result["accept_length_histogram"]
    ax1.bar([int(k) for k in hist], list(hist.values()))
    ax1.set(title="accepted draft tokens per round", xlabel="accepted (bonus excluded)", ylabel="rounds")
    alpha = result["acceptance_per_depth"]
    ax2.plot(range(1, len(alpha) + 1), alpha, marker="o")
    ax2.set(title="conditional acceptance per depth", xlabel="depth", ylabel="P(accept d | reached d)", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance.png", dpi=100)
    plt.close(fig)
    lines = ["# Validation report", "",
             f"- head: `{result['head']}` ({result['head_format']}), target: `{result['target']}` on {result['device']} ({result['dtype']})",
             f"- prompts: {result['num_prompts']} held-out, up to {result['max_new_tokens']} new tokens, tree {result['tree']}",
             f"- **tau (tokens per target forward, bonus included): {result['tau']:.3f}**",
             f"- acceptance per depth (conditional): {', '.join(f'{a:.2f}' for a in result['acceptance_per_depth'])}",
             f"- plain decoding {result['plain_tokens_per_s']:.1f} tok/s, speculative {result['spec_tokens_per_s']:.1f} tok/s, "
             f"HF generate {result['hf_generate_tokens_per_s']:.1f} tok/s",
             f"- speedup: {result['speedup_vs_plain']:.2f}x vs plain (same runtime), {result['speedup_vs_hf_generate']:.2f}x vs HF generate",
             f"- draft/target step cost c = {result['draft_to_target_cost_c']:.3f}; expected walltime factor "
             f"tau/(gamma*c+1) = {result['expected_walltime_factor']:.2f} (gamma = depth)",
             f"- low-batch screen: i.i.d. alpha {result['screen']['alpha_iid']:.3f}, break-even c* = (tau-1)/gamma = "
             f"{result['screen']['break_even_c']:.3f} (measured c {result['draft_to_target_cost_c']:.3f}); Theorem 3.8 predicts "
             f"{result['screen']['predicted_walltime_factor']:.2f}x, measured {result['screen']['measured_walltime_factor']:.2f}x",
             f"- greedy output identical to plain greedy decoding: {result['num_exact']}/{result['num_prompts']} prompts; "
             f"to the model's own `generate`: {result['num_exact_vs_generate']}/{result['num_prompts']}",
             f"- passed: **{result['passed']}**"]
    positions = result["screen"].get("per_position") or {}
    if positions:
        lines.append("- tau by position of the drafting round (context length, tokens): " + ", ".join(
            f"{bucket} {stats['tau']:.2f} ({stats['num_rounds']} rounds)" for bucket, stats in positions.items()))
    choice = result.get("depth_choice")
    if choice:
        lines.append("- verify cost by tokens verified (decode steps): " + ", ".join(
            f"{n} {v:.2f}" for n, v in enumerate(choice["verify_cost_by_tokens"], 1)) + "; predicted speedup by chain depth: "
            + ", ".join(f"{d} {s:.2f}x" for d, s in choice["predicted_speedup_by_depth"].items())
            + f"; best depth here: **{choice['best_depth']}**")
    lines += [f"- {RED.format('WARNING: ' + warning)}" for warning in result.get("warnings", [])]
    if len(result.get("per_domain", {})) > 1 or next(iter(result.get("per_domain", {})), "heldout") != "heldout":
        lines += ["", "| domain | prompts | tau | acceptance by depth | vs plain | vs HF generate |", "|---|---|---|---|---|---|"]
        lines += [f"| {d} | {s['num_prompts']} | {s['tau']:.2f} | {' '.join(f'{a:.2f}' for a in s['acceptance_per_depth'])} | "
                  f"{s['speedup_vs_plain']:.2f}x | {s['speedup_vs_hf_generate']:.2f}x |" for d, s in result["per_domain"].items()]
        lines.append("")
    if result.get("non_finite_tensors"):
        lines.append(f"- {RED.format('non-finite head tensors (NaN/inf), not passed: ' + ', '.join(result['non_finite_tensors'][:8]))}")
    if result.get("calibration"):
        top1 = ", ".join(f"{a:.2f}" for a in result["calibration"]["per_head_top1"])
        lines.append(f"- tree built from measured per-head accuracies (top-1 per head: {top1}; "
                     f"{result['calibration']['prompts']}): {len(result['tree']['choices'])} nodes, saved in validation.json")
    if result.get("typical_acceptance"):
        t = result["typical_acceptance"]
        lines.append(f"- typical acceptance (LOSSY, not used for pass/fail): tau {t['tau']:.3f}, {t['tokens_per_s']:.1f} tok/s")
    if result.get("drift"):
        d = result["drift"]
        lines += ["", "## Drift of the fine-tuned target (Medusa-2 changes the served model)", "",
                  f"- teacher-forced top-1 agreement (on the original's greedy continuation): {d['teacher_forced_top1_agreement']:.3f}",
                  f"- free-running greedy outputs: {d['greedy_output_agreement']:.3f} identical; first divergence per prompt "
                  f"(token index, - = none): {', '.join('-' if i is None else str(i) for i in d['first_divergence_per_prompt'])}; "
                  f"positional token agreement {d['greedy_token_agreement']:.3f} (every token after a divergence counts "
                  f"as disagreement) ({d['num_prompts']} prompts)",
                  f"- mean KL(original || fine-tuned) per token: {d['mean_kl_per_token']:.5f}",
                  (f"- perplexity ({d['perplexity_source']}, {d['num_perplexity_conversations']} conversations): original "
                   f"{d['perplexity_original']:.3f}, fine-tuned {d['perplexity_finetuned']:.3f}"
                   if d["perplexity_original"] is not None else f"- perplexity: {d['perplexity_source']}"),
                  "- the speculative output above is exact against the *fine-tuned* target, which is what Medusa-2 serves"]
    lines += ["", "![acceptance](acceptance.png)", ""]
    with artifacts.atomic_path(out_dir / "report.md") as tmp:
        tmp.write_text("\n".join(lines))
    artifacts.write_json(out_dir / "validation.json", result)
