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


def measured_k(meta: dict, default: int) -> int:
    """The K serve commands use: the best measured at batch size 1 by `draftsmith economics`, else `default`."""
    return (meta.get("economics") or {}).get("best_k") or default


def card(title: str, engine: str, meta: dict, validation: dict | None, serve: str, facts: list[str]) -> str:
    """The model card (README.md) of an export: what was trained on what, how it validated, how to serve."""
    recipe = meta.get("recipe", {})
    data = recipe.get("data", {})
    lines = [f"# {title} for {meta.get('target_id')}", "",
             f"Trained with draftsmith; exported for **{engine}**.", "",
             f"- target: `{meta.get('target_id')}`",
             f"- data: {data.get('builtin') or [s.get('path') for s in data.get('sources', [])]}",
             f"- training steps: {meta.get('step')}, tokens: {meta.get('tokens')}"] + [f"- {fact}" for fact in facts]
    if validation:
        alpha = ", ".join(f"{a:.2f}" for a in validation["acceptance_per_depth"])
        lines += [f"- validated: tau {validation['tau']:.2f}, acceptance per depth {alpha}, "
                  f"speedup {validation['speedup_vs_plain']:.2f}x (draftsmith runtime, {validation['device']})",
                  f"- greedy output identical to plain decoding on {validation['num_exact']}/{validation['num_prompts']} prompts"]
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
