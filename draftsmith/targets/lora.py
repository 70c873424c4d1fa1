"""LoRA adapters on the target (peft), for heads trained jointly with it (Medusa-2; joint MTP):
attach them for training, save them in peft's own layout, and rebuild the fine-tuned target
(adapter merged) for validation and export. The original target stays reachable inside a peft
model with `disable_adapter()`: self-distillation needs no second copy in memory."""
from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.recipe import LoraJointConfig


def lora_config(cfg: LoraJointConfig):
    from peft import LoraConfig
    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
                      bias="none", task_type="CAUSAL_LM")


# the MLP names peft maps onto a mixture-of-experts target's fused expert weights (target_parameters)
EXPERT_MLP_NAMES = {"gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2", "w3"}


def check_sharded_lora(cfg: LoraJointConfig, config, layout) -> None:
    """Before loading: peft adapts a mixture-of-experts target's fused expert weights for the MLP names,
    and cannot shard those adapters over tensor- or expert-parallel ranks (its tensor-parallel adapters
    are for linear layers only)."""
    from draftsmith.targets.parallel import num_experts
    named = sorted(EXPERT_MLP_NAMES.intersection(cfg.target_modules))
    if layout.sharded and num_experts(config) and named:
        keep = [m for m in cfg.target_modules if m not in EXPERT_MLP_NAMES]
        raise ValueError(f"head.lora.target_modules: {named} adapt the fused expert weights of this mixture-of-experts "
                         f"target, which peft cannot shard at target.parallel tp={layout.tp} ep={layout.ep}; adapt the "
                         f"attention only (e.g. {keep or ['q_proj', 'k_proj', 'v_proj', 'o_proj']}), or train at tp 1")


def attach_lora(model, cfg: LoraJointConfig, seed: int = 0):
    """The target wrapped with fresh adapters (B = 0: the adapted model starts equal to the target).
    A tensor-parallel target (transformers' DTensor shards) gets adapters sharded alike: peft shards
    A of a rowwise layer and B of a colwise one, and gathers nothing."""
    from peft import get_peft_model
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    absent = [m for m in cfg.target_modules if m not in names]
    if absent or not cfg.target_modules:
        raise ValueError(f"head.lora.target_modules: {absent or '[]'} name no module of {type(model).__name__}; "
                         f"linear modules it has: {sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))[:6]}...")
    for p in model.parameters():
        p.requires_grad_(False)
    peft_model = get_peft_model(model, lora_config(cfg))
    _draw_adapters(peft_model, seed)
    return peft_model


def _draw_adapters(peft_model, seed: int) -> None:
    """Every A matrix drawn again at its full shape from one seeded generator (peft's own init,
    Kaiming-uniform), each rank keeping its slice: the adapters start the same whatever the layout
    (peft draws a sharded A per rank, from that rank's RNG). Also sets a sharded A's `in_features`
    to the full width: peft leaves the local one, which transformers' rowwise input hook reads as
    the full width (the forward then fails on a reshape)."""
    import math
    from draftsmith.targets.parallel import is_sharded, shard_like
    generator = torch.Generator().manual_seed(seed)
    for name, module in peft_model.named_modules():
        if not (isinstance(module, torch.nn.Linear) and ".lora_A." in f"{name}."):
            continue
        weight = module.weight
        full = torch.empty(weight.shape, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
        with torch.no_grad():
            if is_sharded(weight):
                weight.to_local().copy_(shard_like(full, weight).to_local())
                module.in_features = weight.shape[1]
            else:
                weight.copy_(full)


def save_adapter(peft_model, state: dict[str, torch.Tensor], directory: Path) -> None:
    """peft's layout (adapter_config.json + adapter_model.safetensors) from gathered tensors named
    as `peft_model.state_dict()` names them."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file
    directory.mkdir(parents=True, exist_ok=True)
    adapter = get_peft_model_state_dict(peft_model, state_dict=state)
    save_file({k: v.detach().contiguous().cpu() for k, v in adapter.items()}, str(directory / "adapter_model.safetensors"))
    config = peft_model.peft_config["default"]
    config.base_model_name_or_path = getattr(peft_model.get_base_model().config, "_name_or_path", None)
    config.save_pretrained(str(directory))


def merge_adapter(model, adapter_dir: Path):
    """`model` (a loaded target) with the adapter at `adapter_dir` merged in: a plain HF model."""
    from peft import PeftModel
    if not (Path(adapter_dir) / "adapter_config.json").exists():
        raise ValueError(f"{adapter_dir}: no LoRA adapter (adapter_config.json) to merge into the target")
    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()


def save_merged_target(model_dir: str, adapter_dir: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """The fine-tuned target as a plain Hugging Face model + tokenizer, merged in `dtype` exactly as
    validation merges it (load in `dtype`, peft's merge_and_unload), so the saved model is the one validated."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = merge_adapter(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype), adapter_dir)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
