"""What the engines' head layouts share: HF-style decoder-layer config keys, dtype names, the mark
our exports carry, and reading a directory of weights."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith import artifacts

EXPORT_MARK = "draftsmith_export"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
HF_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "num_hidden_layers", "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope_theta",
                 "rope_scaling", "vocab_size", "bos_token_id", "eos_token_id")


class NotServable(ValueError):
    """An engine format that cannot serve this head (its target family, its layout): `draftsmith run`
    skips that format with this reason; an explicit `--to` or `export.formats` stops with it."""


def dtype_keys(dtype: str) -> dict:
    """Both spellings of the export dtype, equal: transformers 5 reads `dtype`, older loaders and the
    engines `torch_dtype`; a config copied from the target must not keep the target's own `dtype`."""
    return {"dtype": TORCH_DTYPE_NAMES[dtype], "torch_dtype": TORCH_DTYPE_NAMES[dtype]}


def fine_tuned_target_dtype(meta: dict) -> torch.dtype:
    """The dtype a merged fine-tuned target is saved in: the one validation ran in (so the exported model
    is the model whose exactness and drift were measured), else the export dtype (unvalidated export)."""
    name = meta.get("validated_dtype")
    return getattr(torch, name) if name else DTYPES[meta.get("export_dtype", "bf16")]


def drift_summary(drift: dict) -> str:
    """One line of a drift report (runtime/drift.py) for a model card."""
    ppl = (f"perplexity {drift['perplexity_original']:.3f} -> {drift['perplexity_finetuned']:.3f}"
           if drift.get("perplexity_original") is not None else "perplexity not measured (no conversations with answers)")
    forced = drift.get("teacher_forced_top1_agreement")  # absent from reports older than the measure
    forced = f"teacher-forced top-1 agreement {forced:.3f}, " if forced is not None else ""
    return (f"{forced}greedy token agreement {drift['greedy_token_agreement']:.3f} (positional), "
            f"mean KL/token {drift['mean_kl_per_token']:.4f}, {ppl}")


def cast(tensors: dict, dtype: str) -> dict:
    """Floating tensors to the export dtype; integer and bool buffers (d2t, t2d) unchanged."""
    return {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's *.safetensors and *.bin files (and *.pt: FasterDecoding's Medusa heads)."""
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    for file in sorted(directory.glob("*.bin")) + sorted(directory.glob("*.pt")):
        tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    if not tensors:
        raise artifacts.ArtifactError(f"{directory}: no *.safetensors, *.bin or *.pt weights")
    return tensors


def complete_vocab_maps(tensors: dict, vocab_size: int) -> dict:
    """`t2d` rebuilt from `d2t` where a layout ships d2t only (vLLM and ModelOpt heads): target id = draft + d2t[draft]."""
    if "t2d" not in tensors and "d2t" in tensors:
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[tensors["d2t"] + torch.arange(len(tensors["d2t"]))] = True
        tensors["t2d"] = t2d
    return tensors


def measured_k(meta: dict, default: int) -> int:
    """The K serve commands use: the best measured at batch size 1 by `draftsmith economics`, else the
    validated depth, else `default`."""
    return (meta.get("economics") or {}).get("best_k") or meta.get("validated_depth") or default


def card(title: str, engine: str, meta: dict, validation: dict | None, serve: str, facts: list[str]) -> str:
    """The model card (README.md) of an export: what was trained on what, how it validated, how to serve."""
    recipe = meta.get("recipe", {})
    data = recipe.get("data", {})
    lines = [f"# {title} for {meta.get('target_id')}", "",
             f"Trained with draftsmith; exported for **{engine}**.", "",
             f"- target: `{meta.get('target_id')}`",
             f"- data: {data.get('builtin') or [s.get('path') for s in data.get('sources', [])]}",
             f"- training steps: {meta.get('step')}, tokens: {meta.get('tokens')}"] + [f"- {fact}" for fact in facts]
    if meta.get("gguf"):
        g = meta["gguf"]
        lines.append(f"- the target is a GGUF file converted from **{g['source_model'] or 'a model its metadata does not name'}** "
                     f"(its metadata); the head was trained on its dequantized weights, so serve that file: "
                     f"`{g['serve_target']}` plus the speculative settings below")
    draft = meta.get("draft_config") or {}
    trained = (draft.get("draftsmith") or {}).get("trained_max_tokens")
    if trained:
        lines.append(f"- trained on samples of up to {trained} tokens; RoPE as the target's (max_position_embeddings "
                     f"{draft.get('max_position_embeddings')}, rope_scaling {json.dumps(draft.get('rope_scaling'))}), so "
                     "engines serve it at the target's context; validation reports tau by position (validation.json)")
    if validation:
        alpha = ", ".join(f"{a:.2f}" for a in validation["acceptance_per_depth"])
        lines += [f"- validated: tau {validation['tau']:.2f}, acceptance per depth {alpha}, "
                  f"speedup {validation['speedup_vs_plain']:.2f}x (draftsmith runtime, {validation['device']})",
                  f"- greedy output identical to plain decoding on {validation['num_exact']}/{validation['num_prompts']} prompts"
                  + (f", to the target's own `generate` on {validation['num_exact_vs_generate']}/{validation['num_prompts']}"
                     if "num_exact_vs_generate" in validation else "")]
        if validation["speedup_vs_plain"] < 1:
            lines.append(f'- <span style="color:red">**slower than plain decoding where it was validated '
                         f'({validation["speedup_vs_plain"]:.2f}x on {validation["device"]})**</span>')
    else:
        lines.append("- **not validated** (exported with --allow-unvalidated)")
    lines += ["", "## Serve", "", "```", serve, "```", ""]
    economics = meta.get("economics")
    if economics:
        lines += [f"K = {economics['best_k']} is the best number of speculative tokens measured at batch size 1 "
                  f"(`draftsmith economics`, {economics['machine']}). Speculation pays up to a batch size; vLLM takes "
                  "the measured K per batch size in its speculative config:", "",
                  "```", f'"num_speculative_tokens_per_batch_size": {json.dumps(economics["schedule"])}', "```", "",
                  f"(crossover: from batch size {economics['crossover_batch_size']} on, plain decoding is faster)"
                  if economics.get("crossover_batch_size") else "(speculation paid at every measured batch size)", ""]
    return "\n".join(lines)
