"""Medusa's engine formats, and import of published Medusa heads.

- vLLM `medusa` (vllm/model_executor/models/medusa.py, transformers_utils/configs/medusa.py): a
  draft directory, config `model_type: medusa`, `architectures: [MedusaModel]`, `num_heads`,
  `num_hidden_layers` (blocks per head), `vocab_size`, `truncated_vocab_size`; tensors
  `blocks.{h}.layers.{l}.weight` (+ `.bias` only with `medusa_fc_bias: true`, so it is set) and
  `lm_heads.{h}.weight`; with `original_lm_head: true` one `lm_head.weight` (vLLM also takes
  `lm_heads.0.weight` for it) that the export copies from the target. vLLM proposes top-1 chains.
- FasterDecoding (Medusa v0.1, read by TGI `--speculate` and TensorRT-LLM's `convert_checkpoint.py
  --medusa_model_dir`): config `medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`;
  weights `medusa_lm_head.safetensors` (TGI) and `medusa_lm_head.pt` (TensorRT-LLM torch.load's
  it) with keys `{h}.{l}.linear.{weight,bias}` and `{h}.{num_layers}.weight` (the head's lm_head).
- Medusa-2 only: `merged-target` (the fine-tuned target, LoRA merged, `save_pretrained`: loads
  with `AutoModelForCausalLM`) and `lora` (the adapter alone, peft's layout), because Medusa-2
  changes the served model: serve the merged target together with the heads.
Import recognizes all three head layouts (and FasterDecoding v1.0's `medusa_head.` prefix)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.heads.hf_layout import EXPORT_MARK, NotServable, card, cast, drift_summary, dtype_keys, fine_tuned_target_dtype, measured_k, read_weights

TITLE = "Medusa heads"
REQUIRED = ("blocks.0.layers.0.weight",)
FINE_TUNED_TARGET_FORMAT = "merged-target"  # what engines serve a Medusa-2 head on (runtime/export.served_target)
ADAPTER_DIR = "lora"  # where a Medusa-2 head keeps its LoRA adapter (peft layout), next to the head


def _num(config: dict) -> tuple[int, int]:
    return config["medusa_num_heads"], config["medusa_num_layers"]


def _shared_lm_head(target: str) -> torch.Tensor:
    from draftsmith.targets.loading import load_target_embeddings
    return load_target_embeddings(target)[1]


def to_vllm(tensors: dict, config: dict, dtype: str, target: str = "") -> tuple[dict, dict]:
    K, L = _num(config)
    named = {k: v for k, v in tensors.items() if k.startswith(("blocks.", "lm_heads."))}
    if config.get("original_lm_head"):
        named["lm_head.weight"] = _shared_lm_head(target)
    out = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": config["hidden_size"],
           "vocab_size": config["vocab_size"], "truncated_vocab_size": config["vocab_size"], "num_heads": K,
           "num_hidden_layers": L, "medusa_fc_bias": True, "original_lm_head": bool(config.get("original_lm_head")),
           "max_paths": 64, "topk": 10, **dtype_keys(dtype),
           EXPORT_MARK: {"engine": "vllm", "kind": "medusa", "variant": config["draftsmith"].get("variant")}}
    return out, cast(named, dtype)


def to_fasterdecoding(tensors: dict, config: dict, dtype: str, target: str = "", served_target: str = "") -> tuple[dict, dict]:
    K, L = _num(config)
    named = {}
    for h in range(K):
        for layer in range(L):
            named[f"{h}.{layer}.linear.weight"] = tensors[f"blocks.{h}.layers.{layer}.weight"]
            named[f"{h}.{layer}.linear.bias"] = tensors[f"blocks.{h}.layers.{layer}.bias"]
        named[f"{h}.{L}.weight"] = _shared_lm_head(target) if config.get("original_lm_head") else tensors[f"lm_heads.{h}.weight"]
    out = {"medusa_num_heads": K, "medusa_num_layers": L, "base_model_name_or_path": served_target or target,
           EXPORT_MARK: {"engine": "fasterdecoding", "kind": "medusa", "variant": config["draftsmith"].get("variant")}}
    return out, cast(named, dtype)


def write_fasterdecoding(out: Path, tensors: dict, meta: dict, head: Path) -> None:
    """TGI reads the safetensors file, TensorRT-LLM's converter the pickle: both are written."""
    save_file(tensors, str(out / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
    torch.save(tensors, out / "medusa_lm_head.pt")


def _require_adapter(config: dict, head: Path | None = None) -> None:
    if config["draftsmith"].get("variant") != "medusa2":
        raise NotServable("this is a Medusa-1 head (frozen target): there is no fine-tuned target or LoRA adapter to export")
    if head is not None and not (head / ADAPTER_DIR / "adapter_config.json").exists():
        raise ValueError(f"{head}/{ADAPTER_DIR}: the Medusa-2 LoRA adapter is missing")


def to_merged_target(tensors: dict, config: dict, dtype: str, target: str = "") -> tuple[dict, dict]:
    _require_adapter(config)
    return {}, {}


def write_merged_target(out: Path, tensors: dict, meta: dict, head: Path) -> None:
    """The target with the adapter merged in, saved as a plain Hugging Face model (+ tokenizer)."""
    from draftsmith.targets.lora import save_merged_target
    _require_adapter(meta["draft_config"], head)
    save_merged_target(meta["target_id"], head / ADAPTER_DIR, out, fine_tuned_target_dtype(meta))


def to_lora(tensors: dict, config: dict, dtype: str, target: str = "") -> tuple[dict, dict]:
    _require_adapter(config)
    return {}, {}


def write_lora(out: Path, tensors: dict, meta: dict, head: Path) -> None:
    _require_adapter(meta["draft_config"], head)
    for file in (head / ADAPTER_DIR).iterdir():
        shutil.copy2(file, out / file.name)


ADAPTERS = {"vllm": to_vllm, "fasterdecoding": to_fasterdecoding, "merged-target": to_merged_target, "lora": to_lora}
WRITERS = {"fasterdecoding": write_fasterdecoding, "merged-target": write_merged_target, "lora": write_lora}


def engines_for(meta: dict) -> list[str]:
    """Every format that applies: the target's own exports only for Medusa-2."""
    heads = ["vllm", "fasterdecoding"]
    return heads + (["merged-target", "lora"] if meta["draft_config"]["draftsmith"].get("variant") == "medusa2" else [])


def serve_command(engine: str, target: str, out: str, depth: int = 4, top_k: int = 10, num_nodes: int = 64) -> str:
    if engine == "vllm":
        return (f"vllm serve {target} --speculative-config "
                f"'{{\"method\": \"medusa\", \"model\": \"{out}\", \"num_speculative_tokens\": {depth}}}'")
    if engine == "fasterdecoding":
        return (f"text-generation-launcher --model-id {out} --speculate {depth}   # TGI (base_model_name_or_path: {target})\n"
                f"python examples/medusa/convert_checkpoint.py --model_dir {target} --medusa_model_dir {out} "
                f"--num_medusa_heads {depth} --num_medusa_layers 1 --max_medusa_token_len {num_nodes - 1}   # TensorRT-LLM")
    if engine == "merged-target":
        return f"vllm serve {out}   # the fine-tuned target: serve it with its Medusa heads (export --to vllm)"
    return f"peft: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('{target}'), '{out}')"


def model_card(engine: str, meta: dict, validation: dict | None, out: str) -> str:
    config = meta["draft_config"]
    K, L = _num(config)
    variant = config["draftsmith"].get("variant", "medusa1")
    facts = [f"{K} heads x {L} residual SiLU block(s) on the target's final hidden state; head k predicts token t+2+k",
             "lm_head: " + ("the target's, shared" if config.get("original_lm_head") else "one per head"),
             f"variant: {variant}"]
    if variant == "medusa2":
        facts.append("**Medusa-2 changes the served model**: the target was fine-tuned with LoRA; serve the merged "
                     f"target (`{meta.get('served_target')}`) with these heads, not the original target")
        facts.append(f"merged target saved in {fine_tuned_target_dtype(meta)}: "
                     + ("the dtype validation ran in (exactness and drift were measured on this model)"
                        if meta.get("validated_dtype") else "the export dtype (not validated)"))
        drift = (validation or {}).get("drift")
        if drift:
            facts.append(f"drift of the fine-tuned target vs the original: {drift_summary(drift)}")
    choices = (validation or {}).get("tree", {}).get("choices")
    if choices:
        facts.append(f"tree (measured): `medusa_choices={json.dumps(choices)}`")
    return card(TITLE, engine, meta, validation, serve_command(engine, meta.get("served_target") or meta.get("target_id") or "<target>",
                                                               out, depth=measured_k(meta, K)), facts)


def recognizes(config: dict) -> bool:
    if (config.get(EXPORT_MARK) or {}).get("kind") == "medusa" or config.get("model_type") == "medusa":
        return True
    return "MedusaModel" in (config.get("architectures") or []) or any(
        "num" in k and "heads" in k and "medusa" in k for k in config)


def _count(config: dict, word: str, default: int | None) -> int | None:
    """vLLM's rule: any key with 'num' and `word` in it names the count."""
    for key, value in config.items():
        if "num" in key and word in key and isinstance(value, int):
            return value
    return default


def _our_names(tensors: dict) -> dict:
    """vLLM names, FasterDecoding `{h}.{l}.linear.*` / `{h}.{L}.weight`, or v1.0's `medusa_head.` prefix."""
    out = {}
    layers = {}
    for name in tensors:
        m = re.fullmatch(r"(?:medusa_head\.|medusa_heads\.)?(\d+)\.(\d+)\.linear\.(weight|bias)", name)
        if m:
            layers.setdefault(int(m[1]), set()).add(int(m[2]))
    for name, tensor in tensors.items():
        plain = name.removeprefix("medusa_heads.")
        if plain.startswith(("blocks.", "lm_heads.", "lm_head.")):
            out[plain] = tensor
            continue
        m = re.fullmatch(r"(?:medusa_head\.)?(\d+)\.(\d+)\.linear\.(weight|bias)", name)
        if m:
            out[f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"] = tensor
            continue
        m = re.fullmatch(r"(?:medusa_head\.)?(\d+)\.(\d+)\.weight", name)
        if m and int(m[2]) == len(layers.get(int(m[1]), ())):
            out[f"lm_heads.{m[1]}.weight"] = tensor
    return out


def import_layout(path, raw: dict, target_config) -> tuple[dict, dict, dict]:
    """(our config, tensors, metadata). The head count is the number of heads the weights hold
    (a published FasterDecoding config understates it: ../REFERENCE part 2 §3)."""
    tensors = _our_names(read_weights(Path(path)))
    heads = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("blocks.")})
    if not heads:
        raise ValueError(f"{path}: no Medusa block weights (blocks.* or {{h}}.{{l}}.linear.*)")
    num_layers = len({k.split(".")[3] for k in tensors if k.startswith("blocks.0.layers.")})
    stated = _count(raw, "heads", None)
    if stated is not None and stated != len(heads):
        print(f"{path}/config.json states {stated} heads, the weights hold {len(heads)}: using {len(heads)}", flush=True)
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    H, V = tensors["blocks.0.layers.0.weight"].shape[0], None
    if H != text.hidden_size:
        raise ValueError(f"{path}: heads of hidden size {H}, the target has {text.hidden_size}; trained for another target")
    for name in ("lm_heads.0.weight", "lm_head.weight"):
        if name in tensors:
            V = tensors[name].shape[0]
    if V is not None and V != text.vocab_size:
        raise ValueError(f"{path}: lm_head of {V} rows, the target's vocabulary has {text.vocab_size}")
    shared = "lm_heads.0.weight" not in tensors
    tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}  # the target's own, reloaded from it
    has_bias = any(k.endswith(".bias") for k in tensors)
    if not has_bias:  # vLLM layout without biases: zeros are the same function
        tensors.update({f"blocks.{h}.layers.{l}.bias": torch.zeros(H) for h in heads for l in range(num_layers)})
    config = {"model_type": "medusa", "hidden_size": H, "vocab_size": text.vocab_size, "medusa_num_heads": len(heads),
              "medusa_num_layers": num_layers, "medusa_fc_bias": True, "original_lm_head": shared, "hidden_act": "silu",
              # an imported head runs on the target it is given (a Medusa-2 export's adapter is not in it)
              "draftsmith": {"kind": "medusa", "layer_ids": [], "feature": "final", "variant": "medusa1"}}
    meta = {"kind": "medusa", "layer_ids": [], "draft_config": config, "target_id": raw.get("base_model_name_or_path"),
            "source_format": (raw.get(EXPORT_MARK) or {}).get("engine") or ("vllm" if raw.get("model_type") == "medusa" else "fasterdecoding")}
    return config, tensors, meta
