"""Export an EAGLE-3 head for an engine: one adapter per engine, each a pure function of
(tensors, draft config, layer ids) -> (config.json dict, named tensors).

Layer ids: ours are input-to-layer. SGLang adds one to its config ids, so its config gets ours-1;
vLLM and speculators use them verbatim. Export refuses a head without a passing validation.json
for its target unless explicitly overridden, and writes the validation summary as a model card."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith import artifacts
from draftsmith.runtime.loading import EXPORT_MARK

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
HF_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "num_hidden_layers", "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope_theta",
                 "rope_scaling", "vocab_size", "bos_token_id", "eos_token_id")


def _cast(tensors: dict, dtype: str) -> dict:
    return {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}


def _eagle3_hf_config(config: dict, ids: list[int], dtype: str, engine: str) -> dict:
    out = {key: config[key] for key in HF_LAYER_KEYS if key in config}
    out.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", draft_vocab_size=config["draft_vocab_size"],
               target_hidden_size=config["target_hidden_size"], tie_word_embeddings=False, torch_dtype=TORCH_DTYPE_NAMES[dtype],
               norm_before_residual=False, attention_bias=False, mlp_bias=False,
               eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
               **{EXPORT_MARK: {"engine": engine, "layer_convention": engine, "draftsmith_layer_ids": config["draftsmith"]["layer_ids"]}})
    return out


def to_sglang(tensors: dict, config: dict, dtype: str, **_) -> tuple[dict, dict]:
    """SGLang `LlamaForCausalLMEagle3`: midlayer.* names, no embedding, config ids = ours - 1."""
    ids = [k - 1 for k in config["draftsmith"]["layer_ids"]]
    return _eagle3_hf_config(config, ids, dtype, "sglang"), _cast(tensors, dtype)


def to_vllm(tensors: dict, config: dict, dtype: str, **_) -> tuple[dict, dict]:
    """vLLM `Eagle3LlamaForCausalLM` reads the same files (it renames midlayer. and d2t itself);
    its aux ids are input-to-layer, so ours go in unchanged."""
    return _eagle3_hf_config(config, list(config["draftsmith"]["layer_ids"]), dtype, "vllm"), _cast(tensors, dtype)


def to_speculators(tensors: dict, config: dict, dtype: str, verifier: str = "", embed: torch.Tensor | None = None,
                   verifier_architectures: list | None = None, speculative_tokens: int = 3) -> tuple[dict, dict]:
    """speculators `eagle3`: layers.0.* names, transformer_layer_config, speculators_config; the
    embedding is stored, as speculators-built checkpoints do."""
    layer = {key: config[key] for key in HF_LAYER_KEYS if key in config}
    layer.update(model_type="llama", attention_bias=False, mlp_bias=False, num_hidden_layers=1)
    out = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.2.0",
           "draft_vocab_size": config["draft_vocab_size"], "target_hidden_size": config["target_hidden_size"],
           "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
           "embed_requires_grad": False, "eagle_aux_hidden_state_layer_ids": list(config["draftsmith"]["layer_ids"]),
           "transformer_layer_config": layer, "torch_dtype": TORCH_DTYPE_NAMES[dtype], "tie_word_embeddings": False,
           "speculators_config": {
               "algorithm": "eagle3", "default_proposal_method": "greedy",
               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                     "verifier_accept_k": 1, "accept_tolerance": 0.0}],
               "verifier": {"name_or_path": verifier, "architectures": verifier_architectures or []}},
           EXPORT_MARK: {"engine": "speculators", "layer_convention": "vllm"}}
    renamed = {k.replace("midlayer.", "layers.0.", 1): v for k, v in tensors.items()}
    if embed is not None:
        renamed["embed_tokens.weight"] = embed
    return out, _cast(renamed, dtype)


ADAPTERS = {"sglang": to_sglang, "vllm": to_vllm, "speculators": to_speculators}
REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")


def serve_command(engine: str, target: str, out: str, depth: int = 3) -> str:
    if engine == "sglang":
        return (f"python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {out} --speculative-num-steps {depth} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {depth + 1}")
    if engine == "vllm":
        return (f"vllm serve {target} --speculative-config "
                f"'{{\"method\": \"eagle3\", \"model\": \"{out}\", \"num_speculative_tokens\": {depth}}}'")
    return f"vllm serve {out}"


def find_validation(head: Path) -> Path | None:
    for candidate in (head / "validation.json", head.parent / "validate" / "validation.json"):
        if candidate.exists():
            return candidate
    return None


def check_validated(head: Path, target: str) -> dict:
    """The head's validation.json must exist, name this head's weights and this target, and pass."""
    path = find_validation(head)
    if path is None:
        raise ValueError(f"{head}: no validation.json (run `draftsmith validate` first, or pass --allow-unvalidated)")
    result = json.loads(path.read_text())
    sha = artifacts.sha256_file(head / "model.safetensors")
    if result.get("head_sha256") != sha:
        raise ValueError(f"{path} validated other weights than {head} (re-run `draftsmith validate`, or --allow-unvalidated)")
    if target and result.get("target") != target:
        raise ValueError(f"{path} validated against target {result.get('target')!r}, not {target!r}")
    if not result.get("passed"):
        raise ValueError(f"{path}: validation did not pass (tau={result.get('tau')}, exact={result.get('exact_match')}); "
                         "pass --allow-unvalidated to export anyway")
    return result


def export_head(head: str, engine: str, out: str, dtype: str = "bf16", allow_unvalidated: bool = False) -> dict:
    """Write config.json + model.safetensors + README.md (model card) for `engine` into `out`."""
    if engine not in ADAPTERS:
        raise ValueError(f"--to {engine!r}: valid engines are {', '.join(ADAPTERS)}")
    head_path = Path(head)
    tensors, meta = artifacts.load_checkpoint(head_path)
    missing = [name for name in REQUIRED if name not in tensors]
    if missing:
        raise artifacts.ArtifactError(f"{head_path}: checkpoint lacks {missing}; engines would silently skip them")
    target = meta.get("target_id") or ""
    validation = None if allow_unvalidated else check_validated(head_path, target)
    extra = {}
    if engine == "speculators":
        extra = _speculators_extras(target, meta)
    config, named = ADAPTERS[engine](tensors, meta["draft_config"], dtype, **extra)
    out_path = Path(out)
    with artifacts.atomic_path(out_path) as tmp:
        tmp.mkdir(parents=True)
        save_file(named, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(engine, meta, validation, str(out_path)))
        if out_path.exists():
            import shutil
            shutil.rmtree(out_path)
    return {"out": str(out_path), "tensors": len(named), "validated": validation is not None,
            "serve": serve_command(engine, target, str(out_path))}


def _speculators_extras(target: str, meta: dict) -> dict:
    from draftsmith.data.target import load_target_embeddings
    embed, architectures = None, []
    if target and (Path(target) / "config.json").exists():
        embed, _ = load_target_embeddings(target)
        architectures = json.loads((Path(target) / "config.json").read_text()).get("architectures", [])
    return {"verifier": target, "embed": embed, "verifier_architectures": architectures}


def model_card(engine: str, meta: dict, validation: dict | None, out: str) -> str:
    recipe = meta.get("recipe", {})
    lines = [f"# EAGLE-3 draft head for {meta.get('target_id')}", "",
             f"Trained with draftsmith; exported for **{engine}**.", "",
             f"- target: `{meta.get('target_id')}`; layer ids (input-to-layer): {meta.get('layer_ids')}",
             f"- data: {recipe.get('data', {}).get('builtin') or [s.get('path') for s in recipe.get('data', {}).get('sources', [])]}",
             f"- training steps: {meta.get('step')}, tokens: {meta.get('tokens')}",
             f"- draft vocabulary: {meta['draft_config']['draft_vocab_size']}"]
    if validation:
        alpha = ", ".join(f"{a:.2f}" for a in validation["acceptance_per_depth"])
        lines += [f"- validated: tau {validation['tau']:.2f}, acceptance per depth {alpha}, "
                  f"speedup {validation['speedup_vs_plain']:.2f}x (draftsmith runtime, {validation['device']})",
                  f"- greedy output identical to plain decoding on {validation['num_exact']}/{validation['num_prompts']} prompts"]
    else:
        lines.append("- **not validated** (exported with --allow-unvalidated)")
    lines += ["", "## Serve", "", "```", serve_command(engine, meta.get("target_id") or "<target>", out), "```", ""]
    return "\n".join(lines)
