"""MTP's engine formats, and import of published MTP layers.

Our names: `modules_.{k}.{enorm,hnorm,eh_proj,shared_head_norm}.weight`, `modules_.{k}.block.*` (the
family's layer, in transformers' in-memory names: MoE experts fused). Engine checkpoints name the
block as the family's checkpoints do (per-expert tensors): converted with transformers' own
`revert_weight_conversion` (and back with its qwen2_moe-style rule: gate_up_proj[e] = cat(gate, up),
down_proj[e] = down).

- `nextn` (SGLang's separate NextN draft, the lmsys/DeepSeek-V3-NextN form): the target's config with
  `num_hidden_layers: 1`, `num_nextn_predict_layers: 1`, architecture `DeepseekV3ForCausalLMNextN`
  (`Glm4MoeForCausalLMNextN` for GLM-4.5); tensors `model.layers.0.{enorm,hnorm,eh_proj,
  shared_head.norm}` + the block; embedding and head come from the target. DeepSeek-V3 and GLM-4.5
  families only.
- `nextn-full` (the target's own checkpoint with its MTP layer, as DeepSeek-V3 ships; vLLM
  `deepseek_mtp` / `glm4_moe_mtp` and SGLang read it): the target's files plus `model-mtp.safetensors`
  with `model.layers.{N}.*` (N = num_hidden_layers) incl. `embed_tokens` and `shared_head.head`
  copies, and `num_nextn_predict_layers` in config.json. Any family can be written; engines serve
  DeepSeek-V3 and GLM-4.5 this way.
- `speculators` (`speculators_model_type: mtp`, `MTPDraftModel`): `mtp_layers.0.{token_layernorm,
  hidden_layernorm,input_proj,final_layernorm}` + the block under `mtp_layers.0.`.
Import: all three, plus a full published checkpoint (DeepSeek-V3 `model.layers.N.*`), MiMo
(`model.mtp_layers.0.*`, concat [hidden, emb]: eh_proj halves swapped) and Qwen3-Next (`mtp.*`)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.heads.hf_layout import EXPORT_MARK, NotServable, card, cast, drift_summary, dtype_keys, fine_tuned_target_dtype, measured_k

TITLE = "MTP module"
REQUIRED = ("modules_.0.eh_proj.weight", "modules_.0.enorm.weight")
NEXTN_ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLMNextN", "glm4_moe": "Glm4MoeForCausalLMNextN"}
VLLM_METHODS = {"deepseek_v3": "deepseek_mtp", "glm4_moe": "glm4_moe_mtp", "qwen3_next": "qwen3_next_mtp"}
QWEN3_NEXT = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "shared_head_norm": "norm"}
OWN = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head_norm": "shared_head.norm"}
SPECULATORS = {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "eh_proj": "input_proj", "shared_head_norm": "final_layernorm"}


def _carrier(config: dict):
    """The family's full model on the meta device (no memory): transformers' name conversion needs it."""
    from transformers import AutoConfig, AutoModelForCausalLM
    keys = {k: v for k, v in config.items() if k not in ("draftsmith", "architectures", "model_type")}
    from draftsmith.heads.mtp.model import with_mtp_layers
    cfg = with_mtp_layers(AutoConfig.for_model(config["model_type"], **keys), config["num_hidden_layers"],
                          config["num_nextn_predict_layers"])
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def block_tensors(tensors: dict, config: dict, module: int, prefix: str) -> dict:
    """Module `module`'s own tensors and its block in checkpoint names under `prefix`."""
    from transformers.core_model_loading import revert_weight_conversion
    N = config["num_hidden_layers"] + module
    ours = f"modules_.{module}.block."
    block = {f"model.layers.{N}.{k[len(ours):]}": v for k, v in tensors.items() if k.startswith(ours)}
    block = revert_weight_conversion(_carrier(config), block)
    return {prefix + k[len(f"model.layers.{N}."):]: v for k, v in block.items()}


def _own(tensors: dict, module: int, prefix: str, names: dict) -> dict:
    return {f"{prefix}{names[n]}.weight": tensors[f"modules_.{module}.{n}.weight"] for n in names}


def _check_one_module(config: dict, engine: str) -> None:
    if config["num_nextn_predict_layers"] != 1:
        raise NotServable(f"--to {engine}: engines load one MTP module (num_nextn_predict_layers 1); this head has "
                         f"{config['num_nextn_predict_layers']}")


def to_nextn(tensors: dict, config: dict, dtype: str, target: str = "") -> tuple[dict, dict]:
    family = config["model_type"]
    if family not in NEXTN_ARCHITECTURES:
        raise NotServable(f"SGLang's NextN drafts serve {sorted(NEXTN_ARCHITECTURES)} targets, not {family!r}: export "
                         "--to nextn-full or speculators, or validate and serve the head in draftsmith's runtime")
    _check_one_module(config, "nextn")
    named = _own(tensors, 0, "model.layers.0.", OWN) | block_tensors(tensors, config, 0, "model.layers.0.")
    out = {k: v for k, v in config.items() if k != "draftsmith"}
    out.update(architectures=[NEXTN_ARCHITECTURES[family]], num_hidden_layers=1, num_nextn_predict_layers=1,
               **dtype_keys(dtype), **{EXPORT_MARK: {"engine": "nextn", "kind": "mtp", "target_num_hidden_layers": config["num_hidden_layers"]}})
    return out, cast(named, dtype)


def to_nextn_full(tensors: dict, config: dict, dtype: str, target: str = "") -> tuple[dict, dict]:
    from draftsmith.targets.loading import load_target_embeddings
    embed, lm_head = load_target_embeddings(target)
    named = {}
    if config["model_type"] == "qwen3_next":  # Qwen3-Next keeps its MTP under mtp.*, sharing embedding and head
        for k in range(config["num_nextn_predict_layers"]):
            named |= block_tensors(tensors, config, k, f"mtp.layers.{k}.")
        return {}, cast(named | _own(tensors, 0, "mtp.", QWEN3_NEXT), dtype)
    for k in range(config["num_nextn_predict_layers"]):
        prefix = f"model.layers.{config['num_hidden_layers'] + k}."
        named |= _own(tensors, k, prefix, OWN) | block_tensors(tensors, config, k, prefix)
        named |= {f"{prefix}embed_tokens.weight": embed, f"{prefix}shared_head.head.weight": lm_head}
    return {}, cast(named, dtype)


def write_nextn_full(out: Path, tensors: dict, meta: dict, head: Path) -> None:
    """The target's own files (copied as they are) + model-mtp.safetensors + num_nextn_predict_layers."""
    import shutil
    target = Path(meta["target_id"])
    if not (target / "config.json").exists():
        raise ValueError(f"--to nextn-full needs the target as a local directory; {meta['target_id']!r} is not one")
    if meta["draft_config"]["draftsmith"].get("joint"):  # the module belongs to the fine-tuned target
        from draftsmith.targets.lora import save_merged_target
        save_merged_target(str(target), head / "lora", out, fine_tuned_target_dtype(meta))
    else:
        for file in target.iterdir():
            if file.is_file() and file.name != "manifest.json":
                shutil.copy2(file, out / file.name)
    save_file(tensors, str(out / "model-mtp.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["num_nextn_predict_layers"] = meta["draft_config"]["num_nextn_predict_layers"]
    config[EXPORT_MARK] = {"engine": "nextn-full", "kind": "mtp"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index, single = out / "model.safetensors.index.json", out / "model.safetensors"
    if not index.exists() and single.exists():
        # transformers reads a lone model.safetensors before any index, so the module's file would stay unseen by
        # `generate(use_mtp=True)`: the target's weights move to a shard that an index names beside the module's
        from safetensors import safe_open
        shard = single.rename(out / "model-target.safetensors")
        with safe_open(str(shard), framework="pt") as f:
            names = list(f.keys())
        index.write_text(json.dumps({"weight_map": {name: shard.name for name in names}}))
    if index.exists():  # the engines and transformers read the files through the index
        data = json.loads(index.read_text())
        data["weight_map"].update({name: "model-mtp.safetensors" for name in tensors})
        files = set(data["weight_map"].values())
        data["metadata"] = {**data.get("metadata", {}), "total_size": sum((out / f).stat().st_size for f in files)}
        index.write_text(json.dumps(data, indent=2) + "\n")


def to_speculators(tensors: dict, config: dict, dtype: str, target: str = "", served_target: str = "",
                   speculative_tokens: int = 3) -> tuple[dict, dict]:
    """speculators `mtp`; `speculative_tokens` is the validated depth (or the K measured best by economics),
    the verifier the model the module serves with (the fine-tuned target after joint training)."""
    _check_one_module(config, "speculators")
    named = _own(tensors, 0, "mtp_layers.0.", SPECULATORS) | block_tensors(tensors, config, 0, "mtp_layers.0.")
    skip = ("draftsmith", "num_nextn_predict_layers", "dtype", "torch_dtype")
    layer = {k: v for k, v in config.items() if k not in skip} | {"num_hidden_layers": 1} | dtype_keys(dtype)
    out = {"architectures": ["MTPDraftModel"], "speculators_model_type": "mtp", "speculators_version": "0.2.0",
           "num_nextn_predict_layers": 1, "transformer_layer_config": layer, **dtype_keys(dtype),
           "speculators_config": {"algorithm": "mtp", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                                        "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                  "verifier": {"name_or_path": served_target or target, "architectures": config.get("architectures") or []}},
           EXPORT_MARK: {"engine": "speculators", "kind": "mtp", "target_num_hidden_layers": config["num_hidden_layers"]}}
    return out, cast(named, dtype)


FINE_TUNED_TARGET_FORMAT = "nextn-full"  # a joint module serves with the fine-tuned target that nextn-full writes
ADAPTERS = {"nextn": to_nextn, "nextn-full": to_nextn_full, "speculators": to_speculators}
WRITERS = {"nextn-full": write_nextn_full}


def engines_for(meta: dict) -> list[str]:
    family = meta["draft_config"]["model_type"]
    return (["nextn"] if family in NEXTN_ARCHITECTURES else []) + ["nextn-full", "speculators"]


def engine_served(family: str) -> bool:
    return family in VLLM_METHODS


def serve_command(engine: str, target: str, out: str, depth: int = 3, family: str = "") -> str:
    if engine == "nextn":
        return (f"python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE --speculative-draft-model-path {out} "
                f"--speculative-num-steps {depth} --speculative-eagle-topk 1 --speculative-num-draft-tokens {depth + 1}")
    if engine == "nextn-full":
        method = VLLM_METHODS.get(family, "mtp")
        return (f"vllm serve {out} --speculative-config '{{\"method\": \"{method}\", \"num_speculative_tokens\": {depth}}}'\n"
                f"python -m sglang.launch_server --model {out} --speculative-algorithm EAGLE --speculative-num-steps {depth} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {depth + 1}")
    return f"vllm serve {out}   # speculators format; the verifier is named inside"


RULES = ("tau and exactness were measured under vLLM's MTP rules: the embedding at sequence position 0 zeroed, and "
         "the module's own output before shared_head.norm fed back at the next depth; SGLang and speculators do "
         "neither, so their acceptance can differ from the tau above (losslessness does not)")


def model_card(engine: str, meta: dict, validation: dict | None, out: str) -> str:
    config = meta["draft_config"]
    family = config["model_type"]
    served = engine_served(family)
    joint = config["draftsmith"].get("variant") == "joint"
    facts = [f"{config['num_nextn_predict_layers']} MTP module(s): enorm, hnorm, eh_proj over [embedding, hidden], one "
             f"{family} decoder layer, shared_head.norm; the target's embedding and lm_head",
             f"variant: {config['draftsmith'].get('variant')}" + (
                 f" (the target was fine-tuned with LoRA: serve the fine-tuned target `{meta.get('served_target')}`, "
                 f"saved in {fine_tuned_target_dtype(meta)})" if joint else ""),
             (f"engines: vLLM (`{VLLM_METHODS.get(family)}`) and SGLang (EAGLE with the MTP layer) serve MTP for "
              f"{family} targets (DeepSeek-V3, GLM-4.5, Qwen3-Next families)" if served else
              f"engines: no engine serves MTP for {family} targets today; this head runs in draftsmith's runtime "
              "(vLLM and SGLang serve MTP for DeepSeek-V3, GLM-4.5 and Qwen3-Next families)"), RULES]
    if joint and (validation or {}).get("drift"):
        facts.append(f"drift of the fine-tuned target vs the original: {drift_summary(validation['drift'])}")
    serve = (serve_command(engine, meta.get("served_target") or meta.get("target_id") or "<target>", out,
                           depth=measured_k(meta, 3), family=family) if served else
             f"# no engine serves MTP for {family} targets: validate and run this head in draftsmith's runtime")
    return card(TITLE, engine, meta, validation, serve, facts)


def recognizes(config: dict) -> bool:
    mark = config.get(EXPORT_MARK) or {}
    if mark.get("kind") == "mtp" or config.get("speculators_model_type") == "mtp":
        return True
    return (any(a.endswith("NextN") for a in config.get("architectures") or []) or bool(config.get("num_nextn_predict_layers"))
            or bool(config.get("mtp_num_hidden_layers")) or config.get("model_type") == "qwen3_next")


def _read(path: Path, wanted) -> dict[str, torch.Tensor]:
    """Only the tensors `wanted(name)` selects, from every safetensors file (a full target stays on disk)."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if wanted(name):
                    out[name] = f.get_tensor(name)
    return out


def _fuse_experts(block: dict) -> dict:
    """Per-expert checkpoint tensors -> transformers' fused in-memory experts (qwen2_moe-style rule)."""
    experts = {}
    for name in list(block):
        m = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if m:
            experts.setdefault(m[2], {})[int(m[1])] = block.pop(name)
    if experts:
        count = len(experts["down_proj"])
        block["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([experts["gate_proj"][e], experts["up_proj"][e]], 0) for e in range(count)])
        block["mlp.experts.down_proj"] = torch.stack([experts["down_proj"][e] for e in range(count)])
    return block


def _layout(raw: dict, target_layers: int) -> tuple[str, dict, bool]:
    """(prefix of the MTP layer, our-name -> their-name map for the module's own tensors, concat [h, e]?)"""
    if raw.get("speculators_model_type") == "mtp":
        return "mtp_layers.0.", SPECULATORS, False
    if raw.get("model_type") == "mimo":
        return "model.mtp_layers.0.", {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "eh_proj": "input_proj",
                                        "shared_head_norm": "final_layernorm"}, True
    if raw.get("model_type") == "qwen3_next":
        return "mtp.", QWEN3_NEXT, False
    if any(a.endswith("NextN") for a in raw.get("architectures") or []):
        return "model.layers.0.", OWN, False
    return f"model.layers.{target_layers}.", OWN, False


def import_layout(path, raw: dict, target_config) -> tuple[dict, dict, dict]:
    from draftsmith.heads.mtp.model import draft_config_from_target
    path = Path(path)
    config = draft_config_from_target(target_config, 1)
    prefix, names, hidden_first = _layout(raw, config["num_hidden_layers"])
    if raw.get("model_type") == "qwen3_next":
        prefix_block = "mtp.layers.0."
    else:
        prefix_block = prefix
    found = _read(path, lambda n: n.startswith((prefix, prefix_block)))
    if not found:
        raise ValueError(f"{path}: no MTP tensors under {prefix!r}")
    tensors = {f"modules_.0.{ours}.weight": found[f"{prefix}{theirs}.weight"] for ours, theirs in names.items()}
    if hidden_first:  # MiMo concatenates [hidden, embedding]: our eh_proj reads [embedding, hidden]
        H = tensors["modules_.0.eh_proj.weight"].shape[0]
        w = tensors["modules_.0.eh_proj.weight"]
        tensors["modules_.0.eh_proj.weight"] = torch.cat([w[:, H:], w[:, :H]], dim=1)
    own = {f"{prefix}{theirs}.weight" for theirs in names.values()} | {f"{prefix}embed_tokens.weight", f"{prefix}shared_head.head.weight"}
    block = {k[len(prefix_block):]: v for k, v in found.items() if k.startswith(prefix_block) and k not in own
             and not k.endswith("weight_scale_inv")}
    tensors |= {f"modules_.0.block.{k}": v for k, v in _fuse_experts(block).items()}
    if tensors["modules_.0.eh_proj.weight"].shape[0] != config["hidden_size"]:
        raise ValueError(f"{path}: an MTP layer of hidden size {tensors['modules_.0.eh_proj.weight'].shape[0]}; the target has "
                         f"{config['hidden_size']}")
    mark = raw.get(EXPORT_MARK) or {}
    meta = {"kind": "mtp", "layer_ids": [], "draft_config": config, "target_id": None,
            "source_format": mark.get("engine") or ("speculators" if "speculators_model_type" in raw else "nextn")}
    return config, tensors, meta
