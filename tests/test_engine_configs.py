"""Every export read the way its engine's loader reads the config: the keys it takes for attention
bias, fc bias, dtype, head_dim and vocabulary decide the parameter set the engine allocates; the export
must supply exactly those tensors, with those shapes, in the dtype the config declares. Rules written
from the loaders (facts, see the docstrings below), sharing nothing with draftsmith's adapters:

- SGLang and vLLM `LlamaDecoderLayer` build attention with `attention_bias or bias`: q/k/v and o_proj
  get biases, which SGLang allocates uninitialised when the checkpoint lacks them. SGLang's Qwen2 layer
  has q/k/v biases always. Both MLPs take `mlp_bias`. head_dim = `head_dim` or hidden / heads.
- SGLang's EAGLE-1/2 fc (`LlamaForCausalLMEagle`) has a bias whatever the config says; vLLM's
  `EagleLlamaForCausalLM` fc takes `eagle_fc_bias` (default none). EAGLE-3's fc: `bias` (SGLang).
- EAGLE-3: midlayer (or layers.0) attention reads 2H; `draft_vocab_size` rows in lm_head; d2t one per
  draft token; t2d skipped by both engines (allowed, not required); no embedding (shared).
- vLLM Medusa: blocks.{h}.layers.{l}.weight [H, H] (+ bias only with `medusa_fc_bias`), lm_heads.{h}
  [truncated_vocab_size, H], or one lm_head with `original_lm_head`.
- dtype: transformers 5 reads `dtype`, older loaders and engines `torch_dtype`; both, where present,
  must name the tensors' dtype."""
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from draftsmith.heads.eagle2 import formats as eagle2_formats
from draftsmith.heads.eagle2.model import Eagle2Head, draft_config_from_target as eagle2_config
from draftsmith.heads.eagle3 import formats as eagle3_formats
from draftsmith.heads.hf_layout import NotServable
from draftsmith.heads.eagle3.model import Eagle3Head, draft_config_from_target as eagle3_config
from draftsmith.heads.medusa import formats as medusa_formats
from draftsmith.heads.medusa.model import MedusaHead, draft_config_from_target as medusa_config
from draftsmith.heads.mtp import formats as mtp_formats
from draftsmith.heads.mtp.model import MTPHead, draft_config_from_target as mtp_config
from draftsmith.heads.peagle import formats as peagle_formats
from draftsmith.heads.peagle.model import PEagleHead
from draftsmith.recipe import HeadConfig

V = 96
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _target(arch: str, **extra):
    keys = dict(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    return AutoConfig.for_model(arch, **(keys | extra))


def _head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def llama_layer_params(c: dict, prefix: str, attn_in: int, qkv_bias: bool, o_bias: bool, input_norm: bool) -> dict:
    """The parameter set of an engine's decoder layer built from config `c` (names as in the checkpoint)."""
    H, I, d = c["hidden_size"], c["intermediate_size"], _head_dim(c)
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = {f"{prefix}self_attn.q_proj.weight": (q, attn_in), f"{prefix}self_attn.k_proj.weight": (kv, attn_in),
           f"{prefix}self_attn.v_proj.weight": (kv, attn_in), f"{prefix}self_attn.o_proj.weight": (H, q),
           f"{prefix}mlp.gate_proj.weight": (I, H), f"{prefix}mlp.up_proj.weight": (I, H),
           f"{prefix}mlp.down_proj.weight": (H, I), f"{prefix}post_attention_layernorm.weight": (H,)}
    if input_norm:
        out[f"{prefix}input_layernorm.weight"] = (H,)
    if qkv_bias:
        out |= {f"{prefix}self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))}
    if o_bias:
        out[f"{prefix}self_attn.o_proj.bias"] = (H,)
    if c.get("mlp_bias"):
        out |= {f"{prefix}mlp.gate_proj.bias": (I,), f"{prefix}mlp.up_proj.bias": (I,), f"{prefix}mlp.down_proj.bias": (H,)}
    return out


def sglang_eagle1(c: dict) -> dict:
    H = c["hidden_size"]
    qwen2 = c["architectures"] == ["Qwen2ForCausalLMEagle"]
    attention_bias = bool(c.get("attention_bias") or c.get("bias"))
    return {"fc.weight": (H, 2 * H), "fc.bias": (H,)} | llama_layer_params(
        c, "layers.0.", H, qkv_bias=qwen2 or attention_bias, o_bias=not qwen2 and attention_bias, input_norm=False)


def vllm_eagle1(c: dict) -> dict:
    H = c["hidden_size"]
    attention_bias = bool(c.get("attention_bias") or c.get("bias"))
    fc = {"fc.weight": (H, 2 * H)} | ({"fc.bias": (H,)} if c.get("eagle_fc_bias") else {})
    return fc | llama_layer_params(c, "layers.0.", H, attention_bias, attention_bias, input_norm=False)


def eagle3_params(c: dict, prefix: str, layer_config: dict) -> dict:
    H, Vd = layer_config["hidden_size"], c["draft_vocab_size"]
    attention_bias = bool(layer_config.get("attention_bias") or layer_config.get("bias"))
    layer = llama_layer_params(layer_config, prefix, 2 * H, attention_bias, attention_bias, input_norm=True)
    fc = {"fc.weight": (H, 3 * c.get("target_hidden_size", H))} | ({"fc.bias": (H,)} if c.get("bias") else {})
    return fc | layer | {f"{prefix}hidden_norm.weight": (H,), "norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,)}


def sglang_eagle3(c: dict) -> dict:
    return eagle3_params(c, "midlayer.", c)


def speculators_eagle3(c: dict) -> dict:
    return eagle3_params(c, "layers.0.", c["transformer_layer_config"])


def vllm_peagle(c: dict) -> dict:
    """vLLM's multi-layer EAGLE-3 draft with parallel drafting: layer 0 as EAGLE-3's, layers 1.. plain Llama layers
    reading H, and the mask state it projects through fc at load."""
    H = c["hidden_size"]
    out = eagle3_params(c, "layers.0.", c) | {"mask_hidden": (1, 1, 3 * c["target_hidden_size"])}
    for i in range(1, c["num_hidden_layers"]):
        out |= llama_layer_params(c, f"layers.{i}.", H, False, False, input_norm=True)
    return out


def vllm_medusa(c: dict) -> dict:
    H, K, L, Vt = c["hidden_size"], c["num_heads"], c["num_hidden_layers"], c["truncated_vocab_size"]
    out = {f"blocks.{h}.layers.{l}.weight": (H, H) for h in range(K) for l in range(L)}
    if c.get("medusa_fc_bias"):
        out |= {f"blocks.{h}.layers.{l}.bias": (H,) for h in range(K) for l in range(L)}
    return out | ({"lm_head.weight": (c["vocab_size"], H)} if c.get("original_lm_head") else
                  {f"lm_heads.{h}.weight": (Vt, H) for h in range(K)})


OPTIONAL = {"t2d", "embed_tokens.weight"}  # read or skipped, never required


def _dtype_declarations(config: dict) -> list[tuple[str, str]]:
    """Every (key path, dtype name) the config declares, nested layer configs included."""
    found = []
    for key, value in config.items():
        if key in ("dtype", "torch_dtype") and value is not None:
            found.append((key, value))
        elif isinstance(value, dict):
            found += [(f"{key}.{k}", v) for k, v in _dtype_declarations(value)]
    return found


def _check(config: dict, tensors: dict, expected: dict | None, dtype: torch.dtype):
    declared = _dtype_declarations(config)
    assert declared and {v for _, v in declared} == {DTYPE_NAMES[dtype]}, declared
    floating = {t.dtype for t in tensors.values() if t.is_floating_point()}
    assert floating == {dtype}
    if expected is not None:
        shapes = {name: tuple(t.shape) for name, t in tensors.items() if name not in OPTIONAL}
        assert shapes == {name: tuple(shape) for name, shape in expected.items()}


def _fill(head, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.05)
    return head


EAGLE2_TARGETS = [("llama", {}), ("llama", {"vocab_size": 32000}), ("mistral", {}), ("qwen2", {}),
                  ("qwen3", {"head_dim": 16})]


@pytest.mark.parametrize("arch, extra", EAGLE2_TARGETS)
@pytest.mark.parametrize("engine, rules", [("sglang", sglang_eagle1), ("vllm", vllm_eagle1)])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_eagle2_exports_supply_what_the_engine_allocates(arch, extra, engine, rules, dtype):
    target = _target(arch, **extra)
    head = _fill(Eagle2Head(eagle2_config(target, fc_bias=False)))
    if engine == "vllm" and head.config["model_type"] == "qwen2":   # vLLM's EAGLE-1 class holds a Llama layer only
        with pytest.raises(NotServable, match="head.layer=llama"):
            eagle2_formats.to_vllm(head.trainable_state(), head.draft_config(), dtype)
        return
    config, tensors = eagle2_formats.ADAPTERS[engine](head.trainable_state(), head.draft_config(), dtype)
    assert "bias" not in config and not config.get("attention_bias")
    _check(config, tensors, rules(config), {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])


def test_a_biased_eagle2_head_keeps_its_fc_bias_in_sglang_and_no_attention_bias():
    head = _fill(Eagle2Head(eagle2_config(_target("llama"), fc_bias=True)))
    config, tensors = eagle2_formats.to_sglang(head.trainable_state(), head.draft_config(), "fp32")
    _check(config, tensors, sglang_eagle1(config), torch.float32)
    torch.testing.assert_close(tensors["fc.bias"], head.fc.bias.detach())


@pytest.mark.parametrize("engine, rules", [("sglang", sglang_eagle3), ("vllm", sglang_eagle3),
                                           ("speculators", speculators_eagle3)])
@pytest.mark.parametrize("arch, extra", [("llama", {}), ("qwen3", {"head_dim": 16})])
def test_eagle3_exports_supply_what_the_engine_allocates(engine, rules, arch, extra):
    head = _fill(Eagle3Head(eagle3_config(_target(arch, **extra), 40, [1, 2, 3])))
    config, tensors = eagle3_formats.ADAPTERS[engine](head.trainable_state(), head.draft_config(), "bf16")
    _check(config, tensors, rules(config), torch.bfloat16)


@pytest.mark.parametrize("shared", [False, True])
def test_medusa_vllm_export_supplies_what_vllm_allocates(shared, tmp_path):
    model = AutoModelForCausalLM.from_config(_target("llama"))
    model.save_pretrained(tmp_path)
    head = _fill(MedusaHead(medusa_config(model.config, HeadConfig(kind="medusa", num_heads=3, shared_lm_head=shared))))
    config, tensors = medusa_formats.to_vllm(head.trainable_state(), head.draft_config(), "bf16", target=str(tmp_path))
    _check(config, tensors, vllm_medusa(config), torch.bfloat16)


@pytest.mark.parametrize("engine", ["nextn", "speculators"])
def test_mtp_export_configs_declare_one_dtype_and_no_attention_bias_they_lack(engine):
    """The MTP block's own tensor set is read back by vLLM's rules in test_mtp.py; here its configs."""
    target = AutoConfig.for_model("deepseek_v3", vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                  num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                                  kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                  max_position_embeddings=256)
    head = MTPHead(mtp_config(target))
    config, tensors = mtp_formats.ADAPTERS[engine](head.trainable_state(), head.draft_config(), "bf16")
    _check(config, tensors, None, torch.bfloat16)
    layer = config.get("transformer_layer_config", config)
    has_bias = any(k.endswith(("q_proj.bias", "o_proj.bias")) for k in tensors)
    assert bool(layer.get("attention_bias") or layer.get("bias")) == has_bias


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_transformers_resolves_the_export_dtype_from_the_written_config(tmp_path, dtype, torch_dtype):
    """transformers 5 resolves `dtype` before `torch_dtype`: a config copied from an fp32 target must not keep
    the target's `dtype` next to the export's `torch_dtype` (it would load as float32)."""
    target = _target("llama")
    target.dtype = torch.float32
    head = _fill(Eagle2Head(eagle2_config(target, fc_bias=False)))
    config, _ = eagle2_formats.to_sglang(head.trainable_state(), head.draft_config(), dtype)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.dtype == torch_dtype and loaded.attention_bias is False


# today's targets (real configs, facts in tests/fixtures/target_configs.json): the full-attention layers' RoPE
# (theta, scaling type, factor) a head built as a full-attention layer must carry
TODAYS_TARGETS = {"openai/gpt-oss-120b": (150000.0, "yarn", 32.0),
                  "meta-llama/Llama-4-Scout-17B-16E-Instruct": (500000.0, None, None),
                  "Qwen/Qwen3-Next-80B-A3B-Instruct": (10000000.0, None, None),
                  "google/gemma-3-27b-it": (1000000.0, "linear", 8.0)}   # not the sliding layers' local 10K


@pytest.mark.parametrize("name", TODAYS_TARGETS)
@pytest.mark.parametrize("kind, engine, rules", [("eagle3", "sglang", sglang_eagle3), ("eagle3", "vllm", sglang_eagle3),
                                                 ("eagle3", "speculators", speculators_eagle3),
                                                 ("peagle", "vllm", vllm_peagle)])
def test_exports_for_todays_targets_are_full_attention_llama_layers_the_engines_build(name, kind, engine, rules):
    """On windowed, chunked, hybrid and MoE targets the head stays a full-attention Llama layer (as every published
    head for them): the config carries the target's sizes and its full-attention RoPE, no window or per-layer types
    that would make an engine build a windowed or hybrid draft layer, and the tensors the engine allocates from it."""
    from conftest import target_config
    target = target_config(name)
    text = target.get_text_config()
    with torch.device("meta"):  # real sizes, shapes only
        if kind == "eagle3":
            head = Eagle3Head(eagle3_config(target, 32000, [2, 3, 4]))
        else:
            head = PEagleHead.from_target(target, HeadConfig(kind="peagle", num_layers=3, mask_token_id=0), [2, 3, 4])
    formats = {"eagle3": eagle3_formats, "peagle": peagle_formats}[kind]
    config, tensors = formats.ADAPTERS[engine](head.trainable_state(), head.draft_config(), "bf16")
    _check(config, tensors, rules(config), torch.bfloat16)
    layer = config.get("transformer_layer_config", config)
    assert (layer["hidden_size"], layer["head_dim"], layer["num_key_value_heads"]) == \
        (text.hidden_size, text.head_dim, text.num_key_value_heads)
    assert not layer.get("sliding_window") and not layer.get("use_sliding_window") and "layer_types" not in layer
    theta, scaling, factor = TODAYS_TARGETS[name]
    assert layer["rope_theta"] == theta
    assert (layer.get("rope_scaling") or {}).get("rope_type") == scaling
    assert (layer.get("rope_scaling") or {}).get("factor") == factor
