"""What every runtime entry point (validate, economics, drift, the benches) starts from: the target with its
trained head on the validation device, the prompts (held-out conversations or `validate.prompts`), the
EOS set, and the checks a loaded head must pass."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

from draftsmith import artifacts
from draftsmith.heads.loading import load_head
from draftsmith.recipe import Recipe


def head_sha(head: Path) -> str | None:
    weights = head / "model.safetensors"
    return artifacts.sha256_file(weights) if weights.exists() else None


def _prompt_ids(recipe: Recipe, tokenizer, conv: dict) -> tuple[list[int], list[str]] | None:
    """A conversation up to its first assistant turn (or a whole user-only one), rendered with the
    chat template and a generation prompt, with its images (each expanded into its image tokens by the
    target's processor); None when it has no user turn to prompt with."""
    from draftsmith.data import images
    from draftsmith.data.conversations import render
    messages = conv["messages"]
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    messages = messages[:first]
    if not any(m["role"] == "user" for m in messages):
        return None
    if recipe.data.system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": recipe.data.system_prompt}] + messages
    text = render(tokenizer, messages, generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    sources = images.images_of(messages)
    if sources:
        ids, _ = images.expand(tokenizer, text, ids, [0] * len(ids), sources, conv.get("id", "a validation prompt"))
    return ids, sources


def prompt_sets(recipe: Recipe) -> list:
    """`validate.prompts` as a list of sets (a single path is one set); empty for the held-out data."""
    from draftsmith.recipe import PromptSet
    chosen = recipe.validate.prompts
    return [] if not chosen else [PromptSet(path=chosen, split="test")] if isinstance(chosen, str) else list(chosen)


def prompts_of_set(recipe: Recipe, tokenizer, prompt_set, limit: int) -> list[tuple[torch.Tensor, str, list[str]]]:
    """Up to `limit` prompts of one set: JSONL lines in the data stage's formats ({"messages"},
    {"conversations"}, {"prompt"}, Alpaca), each with an optional "domain", or a builtin set."""
    from draftsmith.data import prompt_sets as builtin
    from draftsmith.data.conversations import DataError, normalize
    path = Path(prompt_set.path)
    if builtin.is_builtin(prompt_set.path):
        records = [(f"{prompt_set.path}[{i}]", r) for i, r in enumerate(builtin.load(prompt_set.path, prompt_set.split))]
        fallback = prompt_set.path.removeprefix(builtin.PREFIX)
    elif path.is_file():
        records = _jsonl_records(path)
        fallback = path.stem if isinstance(recipe.validate.prompts, list) else "default"
    else:
        raise ValueError(f"validate.prompts={prompt_set.path!r}: no such file (expected a JSONL of conversations or "
                         f"prompts, or one of {', '.join(builtin.PREFIX + n for n in builtin.NAMES)})")
    out = []
    for where, record in records:
        try:
            conv = normalize(record, where)
        except DataError as exc:
            raise ValueError(f"{exc} (or give a 'prompt' string)") from None
        found = _prompt_ids(recipe, tokenizer, conv) if "messages" in conv else None
        if found is None:
            raise ValueError(f"{where}: no user turn to prompt with; give 'prompt' or 'messages'")
        out.append((torch.tensor(found[0]), prompt_set.domain or conv.get("domain") or fallback, found[1]))
        if len(out) >= limit:
            break
    if not out:
        raise ValueError(f"validate.prompts={prompt_set.path!r} holds no prompts")
    return out


def _jsonl_records(path: Path) -> list[tuple[str, dict]]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                records.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
    return records


def validation_prompts(recipe: Recipe, tokenizer, limit: int) -> list[tuple[torch.Tensor, str, list[str]]]:
    """(prompt ids, domain, image sources): held-out conversations up to their first assistant turn (or whole, for
    prompts without an answer), rendered with the chat template; or the `validate.prompts` sets, taken in turn so
    that any first n share the sets evenly. An image-text target's held-out prompts fall in the domains `image`
    and `text`, so that tau is reported for each."""
    from draftsmith.data.prepare import load_heldout
    sets = prompt_sets(recipe)
    if sets:
        chosen = [prompts_of_set(recipe, tokenizer, s, limit) for s in sets]
        interleaved = [p for row in itertools.zip_longest(*chosen) for p in row if p is not None]
        return interleaved[:limit]
    prompts, reads_images = [], getattr(tokenizer, "draftsmith_processor", None) is not None
    for conv in load_heldout(recipe):
        found = _prompt_ids(recipe, tokenizer, conv) if "messages" in conv else None
        if found is not None:
            default = ("image" if found[1] else "text") if reads_images else "heldout"
            prompts.append((torch.tensor(found[0]), str(conv.get("domain", default)), found[1]))
        if len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"{recipe.run_dir}/data/heldout.jsonl has no conversation with a user turn to prompt with "
                         f"(data.heldout_fraction={recipe.data.heldout_fraction}): set validate.prompts to a JSONL of "
                         "prompts, raise data.heldout_fraction and rerun `draftsmith data`, or give sources with more conversations")
    return prompts


def prompt_image_inputs(tokenizer, prompt: torch.Tensor, sources: list[str], model) -> dict | None:
    """An image prompt's pixel inputs (and token types, where the model reads them) on the target's device and
    dtype, for `TargetRunner.prefill` and `generate`; None for a text prompt."""
    from draftsmith.data.images import pixel_inputs
    return pixel_inputs(tokenizer, [sources], "a validation prompt", prompt[None].cpu(), model) if sources else None


def eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, list) else [source])
    return ids


def load_target_and_head(recipe: Recipe, head: str | None, stage: str = "validate"):
    """(target, tokenizer, head on the target's device and dtype, head metadata, head path) on
    `validate.device`; the head must have been trained for this target."""
    from draftsmith.targets import parallel
    from draftsmith.targets.loading import load_target, load_tokenizer, pick_device
    layout = parallel.layout_for(recipe, stage)
    parallel.one_replica(layout, stage)
    device = pick_device() if recipe.validate.device == "auto" else torch.device(recipe.validate.device)
    if layout.sharded:
        device = parallel.rank_device(device)
    torch.manual_seed(recipe.seed)
    model, tokenizer = load_target(recipe, device, layout, stage), load_tokenizer(recipe)
    head_path = Path(head) if head else recipe.run_dir / "head"
    draft_head, meta = load_head(head_path, model.config, parallel.full(model.get_input_embeddings().weight),
                                 parallel.full(model.get_output_embeddings().weight))
    if layout.sharded and draft_head.config.get("draftsmith", {}).get("joint"):
        raise ValueError(f"target.parallel tp={layout.tp}: {head_path} was trained jointly with LoRA adapters on the "
                         "target, which this release merges on a whole target only; validate it at tp=1")
    check_target(meta, model, recipe)
    return model, tokenizer, draft_head.to(device=device, dtype=model.dtype), meta, head_path


def validation_max_len(recipe: Recipe, prompts: list[torch.Tensor]) -> int:
    """The runtime's cache length for decoding these prompts with `validate`'s settings (the longest prompt, its new
    tokens and the largest tree)."""
    cfg = recipe.validate
    return max(len(p) for p in prompts) + cfg.max_new_tokens + cfg.num_nodes + cfg.depth * cfg.top_k + 8


def validation_drafter(recipe: Recipe, draft_head, max_len: int, device: torch.device):
    """The head's drafter with `validate`'s tree, its draft step compiled where the device allows (CUDA graphs)."""
    from draftsmith.heads.drafting import TreeConfig
    from draftsmith.heads.registry import head_spec
    from draftsmith.runtime.compile import step_compiler
    cfg = recipe.validate
    return head_spec(draft_head.kind).drafter(draft_head, max_len, TreeConfig(cfg.depth, cfg.top_k, cfg.num_nodes, cfg.tree_choices),
                                              step_compiler("auto", device))


def non_finite_tensors(module) -> list[str]:
    """Names of the head's tensors holding NaN or inf: verification stays lossless with such a head
    (tau 1), so exactness alone would pass it."""
    return [name for name, tensor in module.state_dict().items()
            if tensor.is_floating_point() and not torch.isfinite(tensor).all()]


def check_target(meta: dict, model, recipe: Recipe, where: str = "head") -> None:
    vocab = model.config.get_text_config().vocab_size
    if meta["draft_config"]["vocab_size"] != vocab:
        raise ValueError(f"{where}: vocab_size {meta['draft_config']['vocab_size']} does not match the target's {vocab} "
                         f"({recipe.target.model}); this head was trained for another target")
    if meta.get("target_id") and meta["target_id"] != recipe.target.model:
        print(f"warning: head was trained for {meta['target_id']}, validating against {recipe.target.model}", flush=True)
