"""DFlash's engine formats.

- `vllm`, `sglang`: the z-lab layout both read (vLLM's `dflash` method, class DFlashDraftModel ->
  DFlashQwen3ForCausalLM; SGLang's `DFLASH`): `architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"`,
  `block_size`, `num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}` with z-lab's
  output-of-layer ids (ours - 1; both engines add one when they capture), Qwen3 sizes, no embedding or lm_head
  (the engines share the target's). A head with a draft vocabulary adds `draft_vocab_size` and the tensors
  `lm_head.weight` [draft_vocab_size, H], `d2t` and `t2d`, which vLLM's DFlash loads (target id = draft id + d2t);
  SGLang's DFLASH has no lm_head of its own, so such a head is not written for it.
- `speculators`: `speculators_model_type: "dflash"`, `DFlashSpeculator`, `transformer_layer_config` (a Qwen3
  config), `aux_hidden_state_layer_ids` (ours), `block_size`, `mask_token_id`, `speculators_config`, and the
  target's `embed_tokens.weight` and `lm_head.weight` with identity `d2t`/`t2d` (read from the target directory);
  with a draft vocabulary, `draft_vocab_size`, the head's own lm_head rows and maps.
- `transformers`: transformers' own DFlash assistant (`MuseGlimmerAssistantModel`, model_type
  `muse_glimmer_assistant`), which `generate(..., assistant_model=..., speculation_type="dflash")` drafts with:
  `target_layer_ids` (z-lab's output-of-layer ids), `block_size` and `mask_token_id` at the top level, the context
  projection under `encoder.` (`encoder.fc`, `encoder.output_norm_enc`: our `fc`, `hidden_norm`), the layers and
  `norm` as z-lab names them. Its sliding layers attend both ways inside the block (ours causally, as SpecForge and
  vLLM do) and its `fc` reads features of the draft's own width: heads that differ are not written in it.
Import reads the z-lab layout (and speculators' and transformers') back into our module."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.heads.dflash.model import draft_config_from_target
from draftsmith.heads.hf_layout import EXPORT_MARK, HF_LAYER_KEYS, NotServable, card, cast, dtype_keys, read_weights

TITLE = "DFlash block drafter"
REQUIRED = ("fc.weight", "hidden_norm.weight", "norm.weight")


def _zlab_config(config: dict, dtype: str, engine: str) -> dict:
    out = {key: config[key] for key in HF_LAYER_KEYS if key in config}
    if config.get("draft_vocab_size"):
        out["draft_vocab_size"] = config["draft_vocab_size"]
    out.update(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=config["block_size"],
               num_target_layers=config["num_target_layers"], target_hidden_size=config["target_hidden_size"],
               layer_types=config["layer_types"], sliding_window=config.get("sliding_window"),
               use_sliding_window=bool(config.get("sliding_window")), tie_word_embeddings=False,
               attention_bias=False, dflash_config=dict(config["dflash_config"]), **dtype_keys(dtype),
               **{EXPORT_MARK: {"engine": engine, "layer_convention": "z-lab (output-of-layer)",
                                "draftsmith_layer_ids": config["draftsmith"]["layer_ids"],
                                "mask_token_source": config["draftsmith"].get("mask_token_source")}})
    return out


def to_vllm(tensors: dict, config: dict, dtype: str, target: str = "") -> tuple[dict, dict]:
    return _zlab_config(config, dtype, "vllm"), cast(tensors, dtype)


def to_sglang(tensors: dict, config: dict, dtype: str, target: str = "") -> tuple[dict, dict]:
    if config.get("draft_vocab_size"):
        raise NotServable(f"SGLang's DFLASH drafts through the target's lm_head, over its whole vocabulary; this head drafts "
                          f"over a draft vocabulary of {config['draft_vocab_size']} (head.draft_vocab_size): use vllm or speculators")
    return _zlab_config(config, dtype, "sglang"), cast(tensors, dtype)


def to_speculators(tensors: dict, config: dict, dtype: str, target: str = "") -> tuple[dict, dict]:
    layer = {key: config[key] for key in HF_LAYER_KEYS if key in config}
    layer.update(model_type="qwen3", attention_bias=False, layer_types=config["layer_types"],
                 sliding_window=config.get("sliding_window"), use_sliding_window=bool(config.get("sliding_window")))
    verifier = []
    out, V = dict(tensors), config.get("draft_vocab_size") or config["vocab_size"]
    if target and (Path(target) / "config.json").exists():
        from draftsmith.targets.loading import load_target_embeddings
        embed, lm_head = load_target_embeddings(target)
        out.update({"embed_tokens.weight": embed} | ({} if config.get("draft_vocab_size") else {"lm_head.weight": lm_head}))
        verifier = json.loads((Path(target) / "config.json").read_text()).get("architectures", [])
    if not config.get("draft_vocab_size"):  # the whole vocabulary: identity maps
        out.update(d2t=torch.zeros(V, dtype=torch.long), t2d=torch.ones(V, dtype=torch.bool))
    speculative = config["block_size"] - 1
    return {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "speculators_version": "0.2.0",
            "transformer_layer_config": layer, "draft_vocab_size": V, "block_size": config["block_size"],
            "target_hidden_size": config["target_hidden_size"], "mask_token_id": config["dflash_config"]["mask_token_id"],
            "aux_hidden_state_layer_ids": list(config["draftsmith"]["layer_ids"]), **dtype_keys(dtype),
            "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative}],
                                   "verifier": {"name_or_path": target, "architectures": verifier}},
            EXPORT_MARK: {"engine": "speculators", "layer_convention": "input-to-layer"}}, cast(out, dtype)


TRANSFORMERS_TYPE = "muse_glimmer_assistant"
TRANSFORMERS_NAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}


def to_transformers(tensors: dict, config: dict, dtype: str, target: str = "") -> tuple[dict, dict]:
    if config.get("draft_vocab_size"):
        raise NotServable("transformers' DFlash assistant drafts through the target's lm_head, over its whole vocabulary; "
                          "this head drafts over a draft vocabulary (head.draft_vocab_size): use vllm or speculators")
    if "sliding_attention" in config["layer_types"]:
        raise NotServable("transformers' DFlash assistant attends both ways inside the block in its sliding layers, this "
                          "head's sliding layers causally (SpecForge's and vLLM's convention): use vllm, sglang or speculators")
    family = config["draftsmith"].get("target_model_type") or ""
    if family.startswith("gemma"):
        raise NotServable(f"transformers' DFlash assistant embeds the block with the target's own embedding module, which "
                          f"scales it on {family} targets; this head reads the unscaled embedding")
    if config["target_hidden_size"] != config["hidden_size"]:
        raise NotServable(f"transformers' DFlash assistant reads features of its own width ({config['hidden_size']}), "
                          f"this head the target's ({config['target_hidden_size']})")
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "num_hidden_layers", "rms_norm_eps", "hidden_act", "max_position_embeddings")
    out = {key: config[key] for key in keys}
    out.update(architectures=["MuseGlimmerAssistantModel"], model_type=TRANSFORMERS_TYPE, layer_types=config["layer_types"],
               rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]},
               block_size=config["block_size"], mask_token_id=config["dflash_config"]["mask_token_id"],
               target_layer_ids=list(config["dflash_config"]["target_layer_ids"]), bos_token_id=None, eos_token_id=None,
               pad_token_id=None, **dtype_keys(dtype),
               **{EXPORT_MARK: {"engine": "transformers", "layer_convention": "z-lab (output-of-layer)",
                                "draftsmith_layer_ids": config["draftsmith"]["layer_ids"],
                                "mask_token_source": config["draftsmith"].get("mask_token_source")}})
    return out, cast({TRANSFORMERS_NAMES.get(k, k): v for k, v in tensors.items()}, dtype)


ADAPTERS = {"vllm": to_vllm, "sglang": to_sglang, "speculators": to_speculators, "transformers": to_transformers}


def serve_command(engine: str, target: str, out: str, depth: int = 15) -> str:
    if engine == "sglang":
        return (f"python -m sglang.launch_server --model {target} --speculative-algorithm DFLASH "
                f"--speculative-draft-model-path {out} --speculative-num-draft-tokens {depth + 1}")
    if engine == "transformers":
        return (f"python -c \"from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer; "
                f"tok = AutoTokenizer.from_pretrained('{target}'); model = AutoModelForCausalLM.from_pretrained('{target}'); "
                f"assistant = AutoModel.from_pretrained('{out}'); ids = tok('Hello', return_tensors='pt').input_ids; "
                f"print(tok.decode(model.generate(ids, assistant_model=assistant, speculation_type='dflash', "
                f"do_sample=False, max_new_tokens=64)[0]))\"")
    if engine == "vllm":
        return (f"vllm serve {target} --speculative-config "
                f"'{{\"method\": \"dflash\", \"model\": \"{out}\", \"num_speculative_tokens\": {depth}}}'")
    return f"vllm serve {out}"


def model_card(engine: str, meta: dict, validation: dict | None, out: str) -> str:
    draft = meta["draft_config"]
    facts = [f"layer ids (input-to-layer): {meta.get('layer_ids')}; z-lab target_layer_ids "
             f"{draft['dflash_config']['target_layer_ids']}",
             f"block size {draft['block_size']}, mask token id {draft['dflash_config']['mask_token_id']} "
             f"({draft['draftsmith'].get('mask_token_source')}), {draft['num_hidden_layers']} layers"]
    return card(TITLE, engine, meta, validation, serve_command(engine, meta.get("served_target") or meta.get("target_id") or "<target>", out,
                                                               draft["block_size"] - 1), facts)


def recognizes(config: dict) -> bool:
    if "speculators_model_type" in config:
        return config["speculators_model_type"] == "dflash"
    return ("DFlashDraftModel" in (config.get("architectures") or []) or "dflash_config" in config
            or config.get("model_type") == TRANSFORMERS_TYPE)


def import_layout(path: Path, raw: dict, target_config) -> tuple[dict, dict, dict]:
    """(our draft config, our tensor names, metadata) from a z-lab, speculators or transformers DFlash directory."""
    transformers_layout = raw.get("model_type") == TRANSFORMERS_TYPE
    if "speculators_model_type" in raw:
        layer, ids = raw["transformer_layer_config"], list(raw["aux_hidden_state_layer_ids"])
        block, mask = raw["block_size"], raw["mask_token_id"]
    elif transformers_layout:
        layer, ids = {**raw, "rope_theta": (raw.get("rope_parameters") or {}).get("rope_theta")}, [k + 1 for k in raw["target_layer_ids"]]
        block, mask = raw["block_size"], raw["mask_token_id"]
    else:
        layer, dflash = raw, raw.get("dflash_config") or {}
        ids = [k + 1 for k in dflash["target_layer_ids"]]
        block, mask = dflash.get("block_size", raw.get("block_size")), dflash["mask_token_id"]
    window = layer.get("sliding_window") if layer.get("use_sliding_window", True) else None
    types = layer.get("layer_types")
    vocab = (target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config).vocab_size
    draft_vocab = raw.get("draft_vocab_size") if (raw.get("draft_vocab_size") or vocab) < vocab else None
    config = draft_config_from_target(target_config, ids, layer["num_hidden_layers"], block, mask,
                                      layer.get("intermediate_size"), window if types and "sliding_attention" in types else None,
                                      types, draft_vocab)
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta"):
        if layer.get(key) is not None:
            config[key] = layer[key]
    config["target_hidden_size"] = raw.get("target_hidden_size") or config["target_hidden_size"]
    ours = {v: k for k, v in TRANSFORMERS_NAMES.items()}
    shared = ("embed_tokens", "lm_head", "d2t", "t2d") if draft_vocab is None else ("embed_tokens",)
    tensors = {ours.get(k.removeprefix("model."), k.removeprefix("model.")): v for k, v in read_weights(path).items()
               if not k.removeprefix("model.").startswith(shared)}
    if draft_vocab is not None:
        missing = [k for k in ("lm_head.weight", "d2t") if k not in tensors]
        if missing:
            raise ValueError(f"{path}: config.json has draft_vocab_size {draft_vocab} (below the target's {vocab}) but the "
                             f"weights lack {missing}: a DFlash head with a draft vocabulary carries its lm_head rows and d2t")
        if "t2d" not in tensors:  # vLLM reads d2t alone: the target ids it marks
            tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool)
            tensors["t2d"][tensors["d2t"] + torch.arange(draft_vocab)] = True
    source = "speculators" if "speculators_model_type" in raw else "transformers" if transformers_layout else "z-lab"
    meta = {"kind": "dflash", "layer_ids": ids, "draft_config": config, "target_id": None, "source_format": source}
    return config, tensors, meta
