"""`draftsmith init --target MODEL --kind KIND`: a commented recipe from the target's config alone (offline with
`--config`, as `plan` takes it). It settles what users otherwise work out by hand: layer ids in the engines'
convention, the chat-template settings a thinking model is served with, the draft vocabulary, the smallest
parallel layout that fits (from `plan`), a validation tree sized for a GPU (a chain on recurrent targets), the
launch lines. The data section starts from the builtin prompt sets, answered by the target, so the recipe runs
as written; point it at your own prompts before a real run."""
from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

from draftsmith import recipe as recipe_mod

# per kind: head keys, training settings (the anchors' published ones), the launch config of its training
KINDS = {
    "eagle3": ({"ttt_steps": 7}, {"epochs": 10, "lr": 1e-4, "batch_size": 1, "max_batch_tokens": 4096}, "zero2"),
    "eagle2": ({}, {"epochs": 20, "lr": 3e-5, "batch_size": 4, "max_batch_tokens": 4096}, "ddp"),
    "medusa": ({"num_heads": 4, "num_layers": 1}, {"epochs": 2, "lr": 1e-3, "batch_size": 8, "max_batch_tokens": 4096}, "ddp"),
    "mtp": ({"num_layers": 1}, {"epochs": 4, "lr": 1e-4, "batch_size": 4, "max_batch_tokens": 4096}, "ddp"),
    "dflash": ({"block_size": 16, "num_layers": 5, "num_anchors": 512}, {"epochs": 6, "lr": 6e-4, "batch_size": 4,
                                                                         "max_batch_tokens": 3072}, "ddp"),
    "peagle": ({"num_layers": 4, "ttt_steps": 8}, {"epochs": 10, "lr": 1e-4, "batch_size": 1, "max_batch_tokens": 4096},
               "zero2"),
}
DRAFT_VOCAB = {"eagle3": 32000, "peagle": 32000}
GPU_TREE = {"depth": 6, "top_k": 10, "num_nodes": 60}
CHAIN = {"depth": 6, "top_k": 1, "num_nodes": 7}


def _template_of(target: str, config_path: str | None) -> str | None:
    """The chat template, where it can be read cheaply: files beside the config, a local model directory, a
    GGUF file's metadata, or the Hub's tokenizer files; None when none is at hand (offline `--config` alone)."""
    from draftsmith.targets import gguf
    folder = Path(config_path).parent if config_path and config_path.endswith(".json") else Path(config_path or target)
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        path = folder / name
        if path.is_file():
            text = path.read_text()
            return text if name.endswith(".jinja") else json.loads(text).get("chat_template")
    if gguf.is_gguf(target) and gguf.is_local(target):
        return gguf.chat_template(target)
    if config_path is None and not Path(target).exists():
        try:
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(target).chat_template
        except (OSError, ValueError):
            return None
    return None


def _layout(recipe, config, gpus: int, gpu_memory_gb: float) -> dict:
    """The smallest layout that fits every stage that runs the target (`plan`), as target.parallel keys."""
    from draftsmith.plan import make_plan
    plan = make_plan(recipe, config, gpus, gpu_memory_gb)
    rows = {name: row for name, row in plan["stages"].items() if name in ("regen", "capture", "validate")}
    missing = [name for name, row in rows.items() if not row["fits"]]
    if missing:
        raise ValueError(f"init: {', '.join(missing)} fits no layout of {gpus} x {gpu_memory_gb:.0f} GB; give more "
                         "--gpus (`draftsmith plan` says how many)")
    widest = max(rows.values(), key=lambda row: (row["tp"] * row["pp"], row["ep"]))
    return {"tp": widest["tp"], "pp": widest["pp"], "ep": widest["ep"]}


def init_recipe(target: str, kind: str, config_path: str | None = None, gpus: int = 8, gpu_memory_gb: float = 80.0,
                name: str | None = None) -> str:
    """The recipe's YAML text, comments included; loads as a valid recipe (checked before it is returned)."""
    from draftsmith.heads.registry import head_spec
    from draftsmith.runtime.target import LayerLayout
    from draftsmith.targets.loading import target_config
    spec = head_spec(kind)
    try:
        config = target_config(str(Path(config_path).parent) if config_path and config_path.endswith(".json")
                               else config_path or target)
    except OSError as exc:
        raise ValueError(f"init: cannot read the target's config from {config_path or target!r} ({exc}); pass "
                         "--config PATH") from None
    text = config.get_text_config()
    layers, vocab = text.num_hidden_layers, text.vocab_size
    layer_ids = above_deepstack(config, spec.features.default_layer_ids(layers) if spec.features.feature == "layers" else [])
    template = _template_of(target, config_path) or ""
    thinking = "enable_thinking" in template or "<think>" in template
    recurrent = LayerLayout(config).recurrent
    head_keys, train_keys, launch = KINDS[kind]
    name = name or f"{re.sub(r'[^a-z0-9.]+', '-', Path(target).name.lower().removesuffix('.gguf')).strip('-')}-{kind}"
    head = {"kind": kind, **head_keys} | ({"draft_vocab_size": min(DRAFT_VOCAB[kind], vocab)} if kind in DRAFT_VOCAB else {})
    tree = CHAIN if recurrent else GPU_TREE
    body = {"name": name, "out_dir": "runs", "target": {"model": target, "dtype": "auto"},
            "data": {"sources": [{"path": "builtin:code", "max_records": 4000}, {"path": "builtin:math", "max_records": 2000},
                                 {"path": "builtin:chat"}],
                     **({"chat_template_kwargs": {"enable_thinking": True}} if thinking else {}),
                     "max_length": 4096 if thinking else 2048,
                     "regen": {"enabled": True, "max_new_tokens": 4096 if thinking else 1024, "batch_size": 32}},
            "capture": {"mode": "offline", **({"layer_ids": layer_ids} if layer_ids else {}), "dtype": "bf16"},
            "head": head, "train": {**train_keys, "warmup_ratio": 0.015, "save_every": 1000, "eval_every": 1000,
                                    "tracking": {"backend": "wandb", "tags": [kind]}},
            "validate": {"prompts": [{"path": "builtin:humaneval"}, {"path": "builtin:math"}, {"path": "builtin:chat"}],
                         "num_prompts": 48, "max_new_tokens": 256, **tree}}
    recipe = recipe_mod.loads(json.dumps(body), source="init")
    body["target"]["parallel"] = _layout(recipe, config, gpus, gpu_memory_gb)
    out = _render(body, _header(target, kind, config, layers, vocab, layer_ids, thinking, recurrent, gpus, gpu_memory_gb,
                                launch, body["target"]["parallel"]))
    recipe_mod.loads(out, source="init")  # what init writes always loads
    return out


def above_deepstack(config, ids: list[int]) -> list[int]:
    """Layer ids every engine reads the same features at: above the decoder layers whose outputs an image-text
    target adds deepstack visual features to (Qwen3-VL: layers 0-2), which SGLang captures before the add and HF
    after it. Ids too few to move (a tiny target) stay as they are."""
    added = len(getattr(getattr(config, "vision_config", None), "deepstack_visual_indexes", None) or [])
    moved = list(dict.fromkeys(max(i, added + 1) for i in ids)) if added else ids
    return moved if len(moved) == len(ids) else ids


def _header(target, kind, config, layers, vocab, layer_ids, thinking, recurrent, gpus, gpu_memory_gb, launch, layout) -> list[str]:
    text = config.get_text_config()
    lines = [f"{kind} head for {target} ({text.model_type}, {layers} layers, hidden {text.hidden_size}, vocabulary {vocab}).",
             f"Written by `draftsmith init` on {datetime.date.today()} from the target's config alone."]
    if layer_ids:
        lines.append(f"capture.layer_ids {layer_ids}: input-to-layer ids (HF hidden_states index), as vLLM and speculators "
                     f"read them; SGLang's export writes them minus one ({[i - 1 for i in layer_ids]}).")
    if getattr(config, "vision_config", None) is not None:
        deepstack = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or [])
        lines.append("An image-text target: the head reads the language model's layers and drafts on plain 1D positions; the "
                     "image reaches it through the target's features. Give image conversations as data.sources (OpenAI "
                     "image_url parts, image parts or LLaVA <image> markers); the builtin prompt sets are text only."
                     + (f" The lowest layer id is above the {deepstack} layers the vision tower adds deepstack features "
                        "to (SGLang reads them before the add, HF after)." if deepstack else ""))
    lines.append("data: the thinking template is on: regenerate with thinking, as the model is served by default "
                 "(set enable_thinking: false only for a deployment that turns it off)." if thinking else
                 "data: the target's template has no thinking mode.")
    if recurrent:
        lines.append("The target has recurrent layers (linear attention, state space, convolutions): they advance over one "
                     "chain, so validation drafts a chain (top_k 1).")
    lines.append(f"target.parallel tp {layout['tp']} pp {layout['pp']} ep {layout['ep']}: the smallest layout that fits on "
                 f"{gpus} x {gpu_memory_gb:.0f} GB (draftsmith plan); validate.prompts and the tree are sized for a GPU.")
    lines += ["The data sources are the builtin prompt sets: replace them with the prompts you serve (the target answers",
              "them: data.regen), and keep validate.prompts on the domains you serve.", "Launch (R = this file):",
              f"  draftsmith plan --recipe R --gpus {gpus} --gpu-memory-gb {gpu_memory_gb:.0f}",
              "  draftsmith data --recipe R --regen        (or data.regen.server: a vLLM/SGLang server of the target)",
              "  accelerate launch --config_file recipes/launch/ddp.yaml capture_hidden_states.py --recipe R",
              f"  accelerate launch --config_file recipes/launch/{launch}.yaml train_eagle3.py --recipe R",
              "  draftsmith validate --recipe R && draftsmith export --recipe R", "or all stages at once: draftsmith run --recipe R"]
    return lines


def _render(body: dict, header: list[str]) -> str:
    import yaml
    import textwrap
    text = yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=120)
    comments = [f"# {part}" for line in header for part in textwrap.wrap(line, 114, subsequent_indent="  ",
                                                                      break_on_hyphens=False, drop_whitespace=False) or [""]]
    return "\n".join(c.rstrip() for c in comments) + "\n" + text


def write_recipe(target: str, kind: str, out: str | None, config_path: str | None, gpus: int, gpu_memory_gb: float) -> str:
    """`draftsmith init`: the recipe printed, or written to `out` (never over an existing file)."""
    text = init_recipe(target, kind, config_path, gpus, gpu_memory_gb)
    if out is None:
        return text
    path = Path(out)
    if path.exists():
        raise ValueError(f"init: {out} exists; choose another --out (init never overwrites a recipe)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return f"wrote {out}; next: draftsmith plan --recipe {out} --gpus {gpus} --gpu-memory-gb {gpu_memory_gb:.0f}\n"
