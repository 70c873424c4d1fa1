"""`draftsmith plan`: per-device memory of every stage that runs the target, for a layout, from the
target's config alone (the architecture is built on the meta device: exact parameter counts for any
causal LM, no weight read), and the smallest layout that fits. Each stage checks the same numbers
at start, before loading weights, and refuses a layout that cannot fit.

Per device, with b bytes per value of the recipe's dtype and a replica of tp * pp devices:
  weights      params * b / (tp * pp)            (experts split over ep = tp ranks: the same share)
  KV cache     tokens * 2 * layers * kv_heads * head_dims * b / (tp * pp)
  activations  capture: batch_tokens * (8 * hidden + 3 * ffn / tp) * b; regen/validate: logits in fp32
  head         train: trainable head params * 16 bytes (weights, grads, fp32 master, two Adam moments)
               + the frozen target layers the trainer reads; validate: the head's weights.
  head's step  train: linear in the sample's tokens (head_activation_bytes)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from draftsmith.heads.eagle_layer import DEFAULT_DRAFT_VOCAB
from draftsmith.targets.parallel import Layout, num_experts

GIB = 2 ** 30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
STORE_BYTES = {**DTYPE_BYTES, "fp8": 1}
HEADROOM = 0.9          # fraction of a device's memory a plan may fill (allocator fragmentation, CUDA context)
HOST = "host_buffers"    # a stage part that is host RAM, not device memory (capture's store buffers)
MFU = 0.4               # the throughput assumption behind the time and write-rate columns
STAGES = ("regen", "capture", "train", "validate")
ONE_REPLICA = ("validate", "economics")


@dataclass(frozen=True)
class TargetFacts:
    """What the estimates need from a target's config."""
    name: str
    params: int
    active_params: int          # per token (a mixture of experts runs experts_per_tok of them)
    layer_params: int           # one decoder layer (the largest)
    embed_params: int           # input embedding + lm_head
    layers: int
    hidden: int
    ffn: int                    # the FFN width a token runs through (MoE: experts_per_tok * expert width)
    vocab: int
    heads: int
    kv_heads: int
    kv_values_per_token: int    # K and V values cached per token per layer (all heads)
    experts: int
    config: object
    kv_layers: int = 0          # layers that cache K and V (recurrent and MLP-only layers keep a state or nothing)


def _empty_model(config):
    """The architecture on the meta device: shapes only (a fused expert tensor of DeepSeek-V3 alone is 30 GB); an
    image-text target with its vision tower."""
    from draftsmith.targets.loading import model_class
    with torch.device("meta"):
        return model_class(config).from_config(config)


def target_facts(config, name: str = "") -> TargetFacts:
    text = config.get_text_config()
    model = _empty_model(config)
    params = sum(p.numel() for p in model.parameters())
    experts = num_experts(config)
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    per_tok = getattr(text, "num_experts_per_tok", 0) or 0
    active = params - expert_params + (expert_params * per_tok // experts if experts else 0)
    from draftsmith.targets.features import decoder_of
    layers = decoder_of(model).layers
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if getattr(text, "kv_lora_rank", None):  # MLA as transformers caches it: per head K (nope + rope) and V
        kv_dims = text.qk_nope_head_dim + text.qk_rope_head_dim + text.v_head_dim
    else:
        kv_dims = 2 * (getattr(text, "head_dim", None) or text.hidden_size // heads)
    ffn = (getattr(text, "moe_intermediate_size", 0) or 0) * per_tok if experts else text.intermediate_size
    embed = model.get_input_embeddings().weight.numel()
    embed += 0 if getattr(text, "tie_word_embeddings", False) else model.get_output_embeddings().weight.numel()
    from transformers.cache_utils import get_layer_types_and_kwargs
    kv_layers = sum(t in ("full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding")
                    for t in get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0])
    return TargetFacts(name or getattr(text, "_name_or_path", ""), params, active,
                       max(sum(p.numel() for p in layer.parameters()) for layer in layers), embed,
                       len(layers), text.hidden_size, ffn, text.vocab_size, heads, kv_heads, kv_heads * kv_dims,
                       experts, config, kv_layers)


def _head_params(recipe, facts: TargetFacts) -> tuple[int, int]:
    """(trainable, all) parameters of the recipe's head, built on the meta device."""
    from draftsmith.data.capture import layer_ids_for
    from draftsmith.heads.registry import head_spec
    spec = head_spec(recipe.head.kind)
    layer_ids = layer_ids_for(recipe, facts.layers, spec.features)
    with torch.device("meta"):  # shapes only: a DeepSeek-V3 MTP layer alone is 11B parameters
        head = spec.model.from_target(facts.config, recipe.head, layer_ids)
    return (sum(p.numel() for p in head.parameters() if p.requires_grad), sum(p.numel() for p in head.parameters()))


def dtype_bytes(recipe) -> int:
    """Bytes per value of the target's dtype; `auto` is bf16, what a GPU loads a real target in."""
    return DTYPE_BYTES.get(recipe.target.dtype, 2)


def weight_bytes(facts: TargetFacts, layout: Layout, b: int) -> float:
    """One rank's share of the target's weights: every tensor split over the replica's tp * pp devices."""
    return facts.params * b / (layout.tp * layout.pp)


def kv_cache_bytes(facts: TargetFacts, num_tokens: int, layout: Layout, b: int) -> float:
    """One rank's static KV cache for `num_tokens` positions: its own KV heads (tp) of its own attention layers
    (pp). Windowed layers count whole: the runtime keeps their whole KV so that trees commit exactly."""
    return num_tokens * facts.kv_layers * facts.kv_values_per_token * b / (layout.tp * layout.pp)


def stage_memory(recipe, facts: TargetFacts, layout: Layout, stage: str, zero3: bool = False) -> dict:
    """Per-device bytes of `stage` at `layout`, by part. `zero3`: the head's training state sharded over
    every data-parallel rank (recipes/launch/zero3.yaml) instead of replicated."""
    b = dtype_bytes(recipe)
    kv_per_token = kv_cache_bytes(facts, 1, layout, b)
    parts = {"weights": weight_bytes(facts, layout, b)}
    data = recipe.data
    if stage == "regen":  # under pp one conversation at a time (data/regen.py)
        batch = data.regen.batch_size if layout.pp == 1 else 1
        parts["kv_cache"] = batch * (data.max_length + data.regen.max_new_tokens) * kv_per_token
        parts["activations"] = batch * data.max_length * (8 * facts.hidden * b) + batch * facts.vocab * 4 * 2
    elif stage == "capture":  # capture.chunk_tokens: one chunk's activations, and the cache of the batch's tokens
        chunk = recipe.capture.chunk_tokens
        tokens = min(recipe.capture.batch_tokens, chunk) if chunk else recipe.capture.batch_tokens
        parts["activations"] = tokens * (8 * facts.hidden + 3 * facts.ffn / layout.tp) * b
        if chunk:
            parts["kv_cache"] = max(recipe.capture.batch_tokens, data.max_length) * kv_per_token
    elif stage in ("validate", "economics"):  # economics sizes its batches to the memory left (economics.memory_fraction)
        v = recipe.validate
        parts["kv_cache"] = (data.max_length + v.max_new_tokens + v.num_nodes) * kv_per_token
        parts["head"] = _head_params(recipe, facts)[1] * b
        parts["activations"] = v.num_nodes * facts.vocab * 4 * 3
    elif stage == "train":
        trainable, total = _head_params(recipe, facts)
        online = recipe.capture.mode == "online" or recipe.head.lora is not None
        if online:
            parts["activations"] = recipe.train.max_batch_tokens * (8 * facts.hidden + 3 * facts.ffn / layout.tp) * b
        if recipe.head.lora is not None:  # backward through the adapted target: what every layer keeps for it
            # (Korthikanti et al. 2022, no recompute, fused attention: (10 + 24 / tp) h bytes per token in 16 bits)
            parts["activations"] += recipe.train.max_batch_tokens * facts.layers / layout.pp * \
                (10 + 24 / layout.tp) * facts.hidden * b / 2
        else:  # offline: the trainer reads the embedding, the lm_head and the layers it rebuilds features with
            ids = _layer_ids(recipe, facts)
            kept = (ids[0] + facts.layers - ids[-1]) if ids and recipe.capture.recompute else 0
            parts["weights"] = (facts.embed_params + kept * facts.layer_params) * b
        parts["head"] = (trainable * 16 + (total - trainable) * b) / (layout.dp if zero3 else 1)
        parts["activations"] = parts.get("activations", 0) + head_activation_bytes(recipe, facts)
    else:
        raise ValueError(f"plan: unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    parts["total"] = sum(parts.values())
    if stage == "capture":  # host RAM, not the device's: a batch's features, converted to the store's dtype and compressed
        parts[HOST] = recipe.capture.batch_tokens * store_bytes_per_token(recipe, facts) * 3
    return parts


def head_activation_bytes(recipe, facts: TargetFacts) -> float:
    """The head's training step on a batch of T = train.max_batch_tokens tokens, fp32, linear in T: per unrolled
    step what backward keeps (24 values per hidden unit and token; one hidden state per token under
    train.activation_checkpointing, plus one step recomputed), and the bounded blocks of the TTT scores, the
    vocabulary loss and the teacher's distribution (heads/ttt.py, heads/objective.py, train/batches.py)."""
    from draftsmith.heads.objective import LOSS_BUDGET
    from draftsmith.heads.ttt import SCORE_BUDGET
    from draftsmith.train.batches import TEACHER_BUDGET
    T, steps, H = recipe.train.max_batch_tokens, recipe.head.ttt_steps or 1, facts.hidden
    if recipe.head.kind == "dflash":  # anchors x block rows through num_layers layers; (draft-)vocabulary logits per slot
        from draftsmith.heads.dflash.loss import SCORE_BUDGET as BLOCK_SCORES
        rows = min(recipe.head.num_anchors, T) * (recipe.head.block_size or 16)
        return (rows * recipe.head.num_layers * 24 * H * 4 + T * recipe.head.num_layers * 2 * H * 4
                + rows * (recipe.head.draft_vocab_size or facts.vocab) * 4 * 3
                + min(rows * facts.heads * (T + rows), BLOCK_SCORES) * 4 * 3)
    vocab = (recipe.head.draft_vocab_size or DEFAULT_DRAFT_VOCAB) if recipe.head.kind in ("eagle3", "peagle") else facts.vocab
    if recipe.head.kind == "peagle":  # COD: depth d keeps a max(r^d, r_min) share of the positions, through N layers
        r, r_min = recipe.head.cod_ratio, recipe.head.cod_min_ratio
        steps = recipe.head.num_layers * (1 + sum(max(r ** d, r_min) for d in range(1, recipe.head.ttt_steps or 8)))
    kept = T * steps * H * 4 + T * 24 * H * 4 if recipe.train.activation_checkpointing else T * steps * 24 * H * 4
    blocks = min(T * vocab, LOSS_BUDGET) * 4 * 3 + min(T * facts.heads * T, SCORE_BUDGET) * 4 * 3
    return kept + blocks + min(T * vocab, TEACHER_BUDGET) * 4


def store_bytes_per_token(recipe, facts: TargetFacts) -> int:
    """Bytes a token takes in the capture store, uncompressed. A compact store holds every feature but
    the lowest; a full one all of them and the teacher."""
    ids = _layer_ids(recipe, facts)
    features = (len(ids) - 1 if recipe.capture.recompute else len(ids) + 1) if ids else 1
    return features * facts.hidden * STORE_BYTES[recipe.capture.dtype]


def device_parts(parts: dict) -> dict:
    """The parts that live on the device (the host buffers left out), total excepted."""
    return {k: v for k, v in parts.items() if k not in ("total", HOST)}


def _gib(value: float) -> str:
    return f"{value / GIB:.3g}"


def _layer_ids(recipe, facts: TargetFacts) -> list[int]:
    from draftsmith.data.capture import layer_ids_for
    from draftsmith.heads.registry import capture_needs
    return layer_ids_for(recipe, facts.layers, capture_needs(recipe.head.kind))


def candidate_layouts(facts: TargetFacts, gpus: int, stage: str) -> list[Layout]:
    """Layouts in the order a plan prefers them: fewest devices per replica, tp over pp, pp only where no
    tp layout fits."""
    out = []
    for size in range(1, gpus + 1):
        if gpus % size:
            continue
        for tp in sorted(t for t in range(1, size + 1) if size % t == 0)[::-1]:
            pp = size // tp
            if facts.heads % tp or facts.kv_heads % tp or (pp > 1 and (stage != "regen" or facts.layers < pp)):
                continue
            if facts.experts and tp > 1 and facts.experts % tp:
                continue
            # validation and economics run one replica (its tp * pp devices), and so do pipeline stages
            one = stage in ONE_REPLICA or pp > 1
            out.append(Layout(tp, pp, tp if facts.experts and tp > 1 else 1, world=size if one else gpus))
    return sorted(out, key=lambda layout: layout.pp > 1)  # pipeline stages last: they regenerate one conversation at a time


def smallest_fit(recipe, facts: TargetFacts, gpus: int, device_bytes: float, stage: str) -> tuple[Layout | None, dict]:
    """The first candidate layout that fits; training tries a replicated head first, then ZeRO-3."""
    for zero3 in ((False, True) if stage == "train" else (False,)):
        for layout in candidate_layouts(facts, gpus, stage):
            parts = stage_memory(recipe, facts, layout, stage, zero3)
            if parts["total"] <= HEADROOM * device_bytes:
                return layout, parts | ({"zero3": True} if zero3 else {})
    return None, {}


def forwards(recipe, facts: TargetFacts, stage: str, num_tokens: int | None, num_conversations: int | None) -> str:
    """The expected number of target forwards of a stage (per replica, the whole job)."""
    if stage == "capture":
        return f"{math.ceil(num_tokens / recipe.capture.batch_tokens)} batches of {recipe.capture.batch_tokens} tokens" \
            if num_tokens else "one per batch of capture.batch_tokens"
    if stage == "regen":
        per = recipe.data.regen.max_new_tokens
        return (f"{math.ceil(num_conversations / recipe.data.regen.batch_size) * (per + 1)} (one prefill + "
                f"{per} decode steps per batch of {recipe.data.regen.batch_size})") if num_conversations else \
            f"{per + 1} per batch of data.regen.batch_size conversations"
    if stage == "validate":
        v = recipe.validate
        return f"at most {v.num_prompts * (v.max_new_tokens + 1) * 3} (speculative, plain and HF generate runs)"
    tokens = (f"; {min(recipe.data.max_length, recipe.train.max_batch_tokens)} tokens per sample, TTT "
              f"{recipe.head.ttt_steps or 1}{', activation checkpointing' if recipe.train.activation_checkpointing else ''}")
    return ("none with an offline store" if recipe.capture.mode == "offline" and recipe.head.lora is None else
            "one per training step (online)") + tokens


STAGE_OF = {"capture": "capture", "train": "train", "validate": "validate", "economics": "economics"}


def check_before_loading(stage: str, recipe, args=None) -> dict:
    """What every stage that runs a sharded target checks at start, from the target's config alone: a
    layout over this rank's device memory is refused before any weight is read (with the smallest one
    that fits). A whole target per rank, or no GPU, is left to load as it is."""
    from draftsmith.targets.loading import target_config
    from draftsmith.targets.parallel import layout_for
    if recipe is None:
        return {}
    name = STAGE_OF.get(stage)
    if stage == "data" and (getattr(args, "regen", False) or recipe.data.regen.enabled) and not recipe.data.regen.server:
        name = "regen"
    if name is None or (name == "capture" and recipe.capture.mode == "online"):
        return {}
    layout = layout_for(recipe, name)
    if not layout.sharded:
        return {}
    return fits_or_refuse(recipe, target_config(recipe.target.model), layout, name, device_memory())


def fits_or_refuse(recipe, config, layout: Layout, stage: str, device_bytes: float | None) -> dict:
    """Before weights are read: the stage's per-device estimate; a layout over the device's memory is
    refused with the smallest one that fits on the same world size."""
    if device_bytes is None:
        return {}
    facts = target_facts(config, recipe.target.model)
    parts = stage_memory(recipe, facts, layout, stage)
    if parts["total"] > HEADROOM * device_bytes:
        better, _ = smallest_fit(recipe, facts, layout.world, device_bytes, stage)
        hint = (f"target.parallel.tp={better.tp} pp={better.pp} ep={better.ep} fits on these {layout.world} devices"
                if better else "no layout of this many devices fits; `draftsmith plan` finds how many are needed")
        raise ValueError(f"{stage} at {layout.describe()}: needs {parts['total'] / GIB:.1f} GiB per device "
                         f"({', '.join(f'{k} {v / GIB:.1f}' for k, v in device_parts(parts).items())}), "
                         f"the device has {device_bytes / GIB:.1f} GiB; {hint}")
    return parts


def device_memory() -> float | None:
    """Bytes of this rank's accelerator; None on CPU (host memory is not what runs out)."""
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return None


def make_plan(recipe, config, gpus: int, gpu_memory_gb: float, nodes: int = 1, gpu_tflops: float = 989.0,
              num_tokens: int | None = None, num_conversations: int | None = None) -> dict:
    if gpus % nodes:
        raise ValueError(f"plan: --gpus {gpus} is not a multiple of --nodes {nodes}")
    facts = target_facts(config, recipe.target.model)
    device_bytes = gpu_memory_gb * 1e9
    b = dtype_bytes(recipe)
    out = {"target": facts.name, "params_b": facts.params / 1e9, "active_params_b": facts.active_params / 1e9,
           "weights_gib": facts.params * b / GIB, "gpus": gpus, "nodes": nodes, "gpu_memory_gb": gpu_memory_gb,
           "stages": {}}
    for stage in STAGES:
        layout, parts = smallest_fit(recipe, facts, gpus, device_bytes, stage)
        row = {"fits": layout is not None, "forwards": forwards(recipe, facts, stage, num_tokens, num_conversations)}
        if parts.pop("zero3", False):
            row["zero3"] = True
        if layout is not None and stage == "regen" and layout.pp > 1:
            row["forwards"] = (f"{recipe.data.regen.max_new_tokens + 1} per conversation, one at a time under pp "
                               "(data/regen.py); a server (data.regen.server) batches them")
        if layout is not None:
            row |= {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "dp": layout.dp,
                    "per_device_gib": {k: float(_gib(v)) for k, v in parts.items()},
                    "crosses_nodes": layout.tp > gpus // nodes}
            if stage == "capture":  # a prefill-shaped forward: compute-bound, so a FLOP rate bounds it
                tokens_per_s = layout.dp * gpu_tflops * 1e12 * MFU * layout.tp * layout.pp / (2 * facts.active_params)
                row["tokens_per_s_at_mfu"] = round(tokens_per_s)
                per_token = store_bytes_per_token(recipe, facts)
                row["store_bytes_per_token"] = per_token
                row["store_write_mb_per_s"] = round(per_token * tokens_per_s / 1e6, 1)
                if num_tokens:
                    row["store_gb"] = round(per_token * num_tokens / 1e9, 1)
        out["stages"][stage] = row
    return out


def render_plan(plan: dict) -> str:
    lines = [f"target {plan['target']}: {plan['params_b']:.1f}B parameters ({plan['active_params_b']:.1f}B active per "
             f"token), {plan['weights_gib']:.1f} GiB of weights; {plan['gpus']} x {plan['gpu_memory_gb']:.0f} GB "
             f"on {plan['nodes']} node(s)"]
    for stage, row in plan["stages"].items():
        if not row["fits"]:
            hint = {"regen": "lower data.regen.batch_size or regenerate through a server (data.regen.server)",
                    "train": "set train.activation_checkpointing: true, lower train.max_batch_tokens or add devices"}.get(stage, "add devices")
            lines.append(f"  {stage:<9} does not fit on {plan['gpus']} devices of {plan['gpu_memory_gb']:.0f} GB: {hint}; "
                         f"forwards: {row['forwards']}")
            continue
        mem = ", ".join(f"{k} {v}" for k, v in device_parts(row["per_device_gib"]).items())
        extra = ""
        if "store_bytes_per_token" in row:
            extra = f"; ~{row['tokens_per_s_at_mfu']} tokens/s at {MFU:.0%} MFU; store {row['store_bytes_per_token']} B/token uncompressed, ~{row['store_write_mb_per_s']} MB/s"
            extra += f", {row['store_gb']} GB in all" if "store_gb" in row else ""
            extra += f"; host RAM for store buffers {row['per_device_gib'][HOST]} GiB per rank"
        lines.append(f"  {stage:<9} tp {row['tp']} x pp {row['pp']} (ep {row['ep']}), dp {row['dp']}"
                     f"{' (tp crosses nodes)' if row['crosses_nodes'] else ''}"
                     f"{', head state sharded by ZeRO-3 (recipes/launch/zero3.yaml)' if row.get('zero3') else ''}: "
                     f"{row['per_device_gib']['total']} GiB "
                     f"per device ({mem}){extra}; "
                     f"forwards: {row['forwards']}")
    return "\n".join(lines)
