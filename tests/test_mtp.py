"""MTP modules: the DeepSeek-V3 module on tiny random DeepSeek-V3 (MLA + MoE) and Llama targets, the
hidden state the engines feed it, the recursive objective written out, drafting (exact greedy,
lossless sampling) in the runtime, NextN / full-checkpoint / speculators exports checked against the
published DeepSeek-V3 layouts and read back by an independent module written from vLLM's rules."""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from conftest import two_token_total_variation

from draftsmith import artifacts
from draftsmith.heads.drafting import TreeConfig
from draftsmith.heads.loading import load_head
from draftsmith.heads.mtp import formats
from draftsmith.heads.mtp.draft import MTPDrafter
from draftsmith.heads.mtp.loss import mtp_loss, step_weights
from draftsmith.heads.mtp.model import MTPHead, draft_config_from_target
from draftsmith.recipe import HeadConfig
from draftsmith.runtime.generate import plain_generate, speculative_generate
from draftsmith.runtime.target import TargetRunner
from draftsmith.runtime.verify import SamplingConfig

PUBLISHED = json.loads((Path(__file__).parent / "fixtures" / "published_mtp_layouts.json").read_text())
V = 96
GREEDY = SamplingConfig()


def deepseek_v3(layers=3):
    return AutoConfig.for_model("deepseek_v3", vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                max_position_embeddings=256, eos_token_id=None, bos_token_id=None)


def llama():
    return LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None)


def _target(config, seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def _head(model, seed=1, steps=1):
    torch.manual_seed(seed)
    head = MTPHead(draft_config_from_target(model.config), ttt_steps=steps)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad and p.dim() > 1:
                p.normal_(0, 0.2)
    head.load_target_weights(model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach())
    return head.eval()


def test_the_block_is_the_target_familys_layer_n():
    """A DeepSeek-V3 target gets its MLA + MoE block (layer index N >= first_k_dense_replace), a Llama its own layer."""
    head = MTPHead(draft_config_from_target(deepseek_v3()))
    block = head.modules_[0].block
    assert type(block).__name__ == "DeepseekV3DecoderLayer" and type(block.mlp).__name__ == "DeepseekV3MoE"
    assert hasattr(block.self_attn, "kv_a_proj_with_mqa")
    assert type(MTPHead(draft_config_from_target(llama())).modules_[0].block).__name__ == "LlamaDecoderLayer"
    assert set(head.trainable_state()) >= {"modules_.0.enorm.weight", "modules_.0.hnorm.weight", "modules_.0.eh_proj.weight",
                                           "modules_.0.shared_head_norm.weight"}
    assert "embed_tokens.weight" not in head.trainable_state() and "lm_head.weight" not in head.trainable_state()


def test_step_weights_are_fastmtps():
    assert step_weights(3, 0.6) == pytest.approx([0.5102, 0.3061, 0.1837], abs=1e-4)
    assert step_weights(1, 0.6) == [1.0]


def test_one_step_loss_is_the_module_written_out():
    """k = 1: eh_proj(cat[enorm(emb(x_{t+1})), hnorm(f_t)]) through the block (plain causal attention), then
    lm_head(shared_head.norm(.)) against the teacher for x_{t+2}; the embedding at position 0 is zeroed."""
    model = _target(llama())
    head = _head(model, steps=1)
    gen = torch.Generator().manual_seed(2)
    B, T, H = 2, 8, 48
    batch = {"input_ids": torch.randint(0, V, (B, T), generator=gen), "aux": torch.randn(B, T, H, generator=gen),
             "position_ids": torch.arange(T).expand(B, T), "target_probs": torch.softmax(torch.randn(B, T, V, generator=gen), -1),
             "target_valid": torch.rand(B, T, generator=gen) > 0.3, "target_argmax": torch.randint(0, V, (B, T), generator=gen)}
    loss, metrics = mtp_loss(head, batch)
    m = head.modules_[0]
    emb = head.embed_tokens(batch["input_ids"][:, 1:])
    emb[:, 0] = 0
    x = m.eh_proj(torch.cat([m.enorm(emb), m.hnorm(batch["aux"][:, :-1])], -1))
    cos, sin = head.rotary(x, batch["position_ids"][:, :-1])
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    h = m.block(x, position_embeddings=(cos, sin), attend=sdpa)
    logits = head.lm_head(m.shared_head_norm(h))
    ce = -(batch["target_probs"][:, 1:] * torch.log_softmax(logits, -1)).sum(-1)
    mask = batch["target_valid"][:, 1:].float()
    torch.testing.assert_close(loss, (ce * mask).sum() / mask.sum(), rtol=1e-5, atol=1e-6)
    three, metrics = mtp_loss(_head(model, steps=3), batch)
    torch.testing.assert_close(three, sum(w * metrics[f"loss_{i}"] for i, w in enumerate(step_weights(3, 0.6))))


def test_a_fresh_module_on_deepseek_v3_is_finite_and_trains():
    """A standalone DeepSeek-V3 decoder layer leaves its packed experts as torch.empty (NaN or ~1e35): every
    parameter of a fresh MTP block is set explicitly, so the first loss and its gradients are finite."""
    from draftsmith.runtime.loading import non_finite_tensors
    model = _target(deepseek_v3())
    for seed in range(3):   # torch.empty's garbage differs run to run: several fresh heads
        torch.manual_seed(seed)
        head = MTPHead(draft_config_from_target(model.config), ttt_steps=2)
        assert non_finite_tensors(head) == []
        assert head.modules_[0].block.mlp.experts.gate_up_proj.abs().max() < 1      # N(0, initializer_range)
        head.load_target_weights(model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach())
        ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        batch = {"input_ids": ids, "aux": out.hidden_states[-1], "position_ids": torch.arange(10).expand(2, 10),
                 "target_probs": torch.softmax(out.logits, -1), "target_valid": torch.ones(2, 10, dtype=torch.bool),
                 "target_argmax": out.logits.argmax(-1)}
        loss, _ = mtp_loss(head, batch)
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in head.parameters() if p.grad is not None)


def test_a_head_with_non_finite_tensors_is_never_exported(tmp_path):
    from draftsmith.runtime.export import export_head
    model = _target(deepseek_v3())
    head = _head(model)
    with torch.no_grad():
        head.modules_[0].eh_proj.weight[0, 0] = float("nan")
    ckpt = _checkpoint(tmp_path, head, _save_target(tmp_path, model))
    with pytest.raises(artifacts.ArtifactError, match=r"non-finite .*modules_.0.eh_proj.weight"):
        export_head(str(ckpt), "speculators", str(tmp_path / "spec"), allow_unvalidated=True)
    assert not (tmp_path / "spec").exists()


def test_the_runtime_feeds_the_final_hidden_state_after_the_norm():
    """What the engines feed (vLLM: DeepseekV2Model returns self.norm(h, residual)): HF hidden_states[-1]."""
    model = _target(deepseek_v3())
    runner = TargetRunner(model, 64, [])
    ids = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(0))
    _, features, _ = runner.prefill(ids)
    with torch.no_grad():
        expected = model(ids[None], output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["deepseek_v3", "llama"])
@pytest.mark.parametrize("depth,top_k,nodes", [(4, 1, 5), (3, 3, 8)])
def test_greedy_speculative_equals_plain_greedy(arch, depth, top_k, nodes):
    model = _target(deepseek_v3() if arch == "deepseek_v3" else llama())
    runner = TargetRunner(model, 160, [])
    drafter = MTPDrafter(_head(model, seed=depth), 160, TreeConfig(depth, top_k, nodes))
    for seed in range(3):
        prompt = torch.randint(0, V, (4 + 5 * seed,), generator=torch.Generator().manual_seed(seed))
        assert speculative_generate(runner, drafter, prompt, 24, GREEDY, set()).tokens == plain_generate(runner, prompt, 24, GREEDY, set()).tokens


def test_sampled_speculative_follows_the_target():
    model = _target(llama())
    runner = TargetRunner(model, 160, [])
    drafter = MTPDrafter(_head(model, seed=4), 160, TreeConfig(3, 3, 8))
    prompt = torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(11))
    tv, support_ok = two_token_total_variation(model, runner, drafter, prompt, SamplingConfig(temperature=1.0, top_k=4), 1200, seed=2)
    assert support_ok and tv < 0.08  # E[TV] of 1200 draws over ~16 outcomes: about 0.045


def test_more_than_one_module_is_refused_by_the_runtime_with_a_reason():
    head = MTPHead(draft_config_from_target(llama(), num_modules=2))
    with pytest.raises(ValueError, match="num_nextn_predict_layers: 1"):
        MTPDrafter(head, 64, TreeConfig(3, 1, 4))


# ---------------------------------------------------------------- exports


def _vllm_rules_module(tensors: dict, prefix: str, config):
    """An MTP step written from vLLM's deepseek_mtp.py: embedding zeroed at position 0, enorm/hnorm,
    eh_proj over [emb, hidden], the DeepSeek-V3 block (transformers' layer N loaded from the checkpoint
    names), logits = shared_head.head(shared_head.norm(h)). Returns fn(ids, h, positions) -> (h', logits)."""
    carrier_cfg = AutoConfig.for_model("deepseek_v3", **{k: v for k, v in config.to_dict().items() if k not in ("model_type",)})
    carrier_cfg.num_hidden_layers = config.num_hidden_layers + 1
    carrier = AutoModelForCausalLM.from_config(carrier_cfg).eval()
    N = config.num_hidden_layers
    state = {f"model.layers.{N}.{k[len(prefix):]}": v.float() for k, v in tensors.items() if k.startswith(prefix)}
    own = {n: state.pop(f"model.layers.{N}.{n}") for n in ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"]}
    head_w = state.pop(f"model.layers.{N}.shared_head.head.weight", None)
    state.pop(f"model.layers.{N}.embed_tokens.weight", None)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:  # transformers' own loader converts the checkpoint names (per-expert tensors)
        from safetensors.torch import save_file
        carrier.save_pretrained(tmp)
        full = load_file(f"{tmp}/model.safetensors") | state
        save_file({k: v.contiguous() for k, v in full.items()}, f"{tmp}/model.safetensors")
        loaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    layer = loaded.model.layers[N]

    def rms(x, w, eps=config.rms_norm_eps):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def step(emb, h, positions, head_weight):
        emb = emb * (positions != 0)[..., None]
        x = torch.cat([rms(emb, own["enorm.weight"]), rms(h, own["hnorm.weight"])], -1) @ own["eh_proj.weight"].T
        pe = loaded.model.rotary_emb(x, positions)
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_embeddings=pe, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        return out, rms(out, own["shared_head.norm.weight"]) @ head_weight.T
    return step, head_w


def _checkpoint(tmp_path, head, target):
    meta = {"kind": "mtp", "target_id": str(target), "layer_ids": [], "draft_config": head.config, "step": 1}
    artifacts.save_checkpoint(tmp_path / "head", head.trainable_state(), meta)
    return tmp_path / "head"


def _save_target(tmp_path, model):
    path = tmp_path / "target"
    model.save_pretrained(path)
    return path


def test_deepseek_exports_match_published_layouts_and_read_back(tmp_path):
    """nextn-full: the published DeepSeek-V3 MTP names at model.layers.N (+ per-expert tensors), the
    target's files and num_nextn_predict_layers; nextn: lmsys/DeepSeek-V3-NextN's names at layer 0 and its
    config; speculators: mtp_layers.0.*. A module written from vLLM's rules gives our logits."""
    from draftsmith.runtime.export import export_head
    config = deepseek_v3()
    model = _target(config)
    target = _save_target(tmp_path, model)
    head = _head(model)
    ckpt = _checkpoint(tmp_path, head, target)
    N = config.num_hidden_layers
    full = tmp_path / "full"
    export_head(str(ckpt), "nextn-full", str(full), dtype="fp32", allow_unvalidated=True)
    mtp = load_file(str(full / "model-mtp.safetensors"))
    published = {k.replace("model.layers.61.", f"model.layers.{N}.") for k in PUBLISHED["deepseek_v3_full"]["mtp_tensors"]}
    assert {k for k in mtp if ".experts." not in k} == published
    assert {k for k in mtp if ".experts." in k} == {f"model.layers.{N}.mlp.experts.{e}.{p}.weight" for e in range(4)
                                                       for p in ("gate_proj", "up_proj", "down_proj")}
    cfg = json.loads((full / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == N
    AutoModelForCausalLM.from_pretrained(full)  # the target still loads from the copy
    nextn = tmp_path / "nextn"
    export_head(str(ckpt), "nextn", str(nextn), dtype="fp32", allow_unvalidated=True)
    ncfg = json.loads((nextn / "config.json").read_text())
    pub = PUBLISHED["deepseek_v3_nextn"]
    assert {k: ncfg[k] for k in pub["config"] if k != "model_type"} == {k: v for k, v in pub["config"].items() if k != "model_type"}
    names = set(load_file(str(nextn / "model.safetensors")))
    assert {k for k in names if ".experts." not in k} == set(pub["mtp_tensors"])
    # the independent module on the exported full checkpoint
    step, head_w = _vllm_rules_module(mtp, f"model.layers.{N}.", config)
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(3))
    h = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(6)[None]
    with torch.no_grad():
        theirs_h, theirs_logits = step(model.get_input_embeddings()(ids), h, pos, head_w)
        sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        ours_h = head.step(ids, h, pos, sdpa)
        torch.testing.assert_close(theirs_logits, head.logits(ours_h), rtol=1e-4, atol=1e-4)
    # import back: each layout gives the same module
    for directory in (full, nextn, tmp_path / "spec"):
        if directory.name == "spec":
            export_head(str(ckpt), "speculators", str(directory), dtype="fp32", allow_unvalidated=True)
        loaded, meta = load_head(directory, config, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        with torch.no_grad():
            torch.testing.assert_close(loaded.logits(loaded.step(ids, h, pos, sdpa)), head.logits(ours_h), rtol=1e-5, atol=1e-5)


def test_nextn_is_refused_for_families_the_engines_do_not_serve(tmp_path):
    from draftsmith.runtime.export import export_head
    model = _target(llama())
    ckpt = _checkpoint(tmp_path, _head(model), _save_target(tmp_path, model))
    with pytest.raises(ValueError, match="NextN drafts serve"):
        export_head(str(ckpt), "nextn", str(tmp_path / "x"), allow_unvalidated=True)
    out = export_head(str(ckpt), "speculators", str(tmp_path / "spec"), allow_unvalidated=True)
    card = (Path(out["out"]) / "README.md").read_text()
    assert "draftsmith's runtime" in card and "vllm serve" not in card and "sglang" not in card.split("## Serve")[1]
    assert "vLLM's MTP rules" in card                       # which engine's rules the tau was measured under


def test_speculators_config_proposes_the_validated_depth(tmp_path):
    """The card's K and the speculators config's speculative_tokens are the validated depth, not a fixed 3."""
    from draftsmith.runtime.export import export_head
    model = _target(deepseek_v3())
    ckpt = _checkpoint(tmp_path, _head(model), _save_target(tmp_path, model))
    validation = {"head_sha256": artifacts.sha256_file(ckpt / "model.safetensors"), "target": str(tmp_path / "target"),
                  "passed": True, "tau": 2.5, "exact_match": True, "num_exact": 4, "num_prompts": 4, "speedup_vs_plain": 0.9,
                  "acceptance_per_depth": [0.6, 0.4, 0.3, 0.2, 0.1], "device": "cpu", "dtype": "torch.float32",
                  "tree": {"depth": 5, "top_k": 1, "num_nodes": 6}}
    (ckpt / "validation.json").write_text(json.dumps(validation))
    out = export_head(str(ckpt), "speculators", str(tmp_path / "spec"), dtype="fp32")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    card = (Path(out["out"]) / "README.md").read_text()
    assert "slower than plain decoding" in card and 'color:red' in card           # speedup 0.9 said in red
    nextn = export_head(str(ckpt), "nextn", str(tmp_path / "nextn"), dtype="fp32")
    assert "--speculative-num-steps 5" in nextn["serve"]


# ---------------------------------------------------------------- end to end on the micro target

MTP = ["head.kind=mtp", "head.ttt_steps=2", "validate.depth=3", "validate.top_k=1", "validate.num_nodes=4",
       "data.max_conversations=80", "train.max_steps=6", "train.log_every=1"]


@pytest.mark.slow
def test_mtp_pipelines_post_hoc_and_joint(tmp_path, micro_target):
    """Post hoc from the capture store: trains, validates exactly, exports nextn-full and speculators (the
    Llama family: the card says the runtime serves it). Joint (LoRA, shared with Medusa-2): trains through
    both stages, validates against the fine-tuned target with the drift report."""
    import argparse
    from conftest import micro_recipe
    from draftsmith.data.capture import run_capture
    from draftsmith.data.prepare import run_data
    from draftsmith.heads.registry import capture_needs
    from draftsmith.runtime.validate import run_validate
    from draftsmith.stages import stage_export
    from draftsmith.train.run import run_train
    recipe = micro_recipe(tmp_path / "post", micro_target, *MTP, "name=mtp")
    run_data(recipe)
    run_capture(recipe, capture_needs("mtp"))
    final = run_train(recipe)["final_metrics"]
    assert {"acc_0", "acc_1", "sim_accept_len"} <= set(final)
    assert run_validate(recipe)["exact_match"]
    written = stage_export(recipe, argparse.Namespace(allow_unvalidated=False))
    assert set(written) == {"nextn-full", "speculators"}
    spec = json.loads((Path(written["speculators"]["out"]) / "config.json").read_text())
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3     # validate.depth
    assert "draftsmith's runtime" in (Path(written["speculators"]["out"]) / "README.md").read_text()
    joint = micro_recipe(tmp_path / "joint", micro_target, *MTP, "name=mtpj", "capture.mode=online",
                         "head.lora={rank: 4, alpha: 8, heads_only_steps: 2, heads_coefficient: 0.3}")
    run_data(joint)
    run_train(joint)
    assert (joint.run_dir / "head" / "lora" / "adapter_model.safetensors").exists()
    assert run_validate(joint)["exact_match"]
    drift = json.loads((joint.run_dir / "validate" / "validation.json").read_text())["drift"]
    assert drift["perplexity_finetuned"] > 1 and 0 <= drift["greedy_token_agreement"] <= 1
    assert 0 <= drift["teacher_forced_top1_agreement"] <= 1
    written = stage_export(joint, argparse.Namespace(allow_unvalidated=False))
    spec = json.loads((Path(written["speculators"]["out"]) / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == written["nextn-full"]["out"]  # the fine-tuned target


@pytest.mark.parametrize("layout", ["mimo", "qwen3_next"])
def test_import_of_mimo_and_qwen3_next_names(tmp_path, layout):
    """MiMo: model.mtp_layers.0.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}, concat
    [hidden, embedding] (REFERENCE part 2 §4); Qwen3-Next: mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,
    norm} and mtp.layers.0.*. Written here from those rules (on a Llama-shaped block), imported, same module."""
    from safetensors.torch import save_file
    model = _target(llama())
    head = _head(model, seed=7)
    state = head.trainable_state()
    H = 48
    if layout == "mimo":
        names = {"enorm": "model.mtp_layers.0.token_layernorm", "hnorm": "model.mtp_layers.0.hidden_layernorm",
                 "eh_proj": "model.mtp_layers.0.input_proj", "shared_head_norm": "model.mtp_layers.0.final_layernorm"}
        block = "model.mtp_layers.0."
    else:
        names = {"enorm": "mtp.pre_fc_norm_embedding", "hnorm": "mtp.pre_fc_norm_hidden", "eh_proj": "mtp.fc",
                 "shared_head_norm": "mtp.norm"}
        block = "mtp.layers.0."
    theirs = {f"{names[n]}.weight": state[f"modules_.0.{n}.weight"] for n in names}
    if layout == "mimo":
        w = theirs["model.mtp_layers.0.input_proj.weight"]
        theirs["model.mtp_layers.0.input_proj.weight"] = torch.cat([w[:, H:], w[:, :H]], 1)   # [hidden, emb]
    theirs |= {block + k[len("modules_.0.block."):]: v for k, v in state.items() if k.startswith("modules_.0.block.")}
    (tmp_path / "pub").mkdir()
    save_file({k: v.contiguous() for k, v in theirs.items()}, str(tmp_path / "pub" / "model.safetensors"))
    (tmp_path / "pub" / "config.json").write_text(json.dumps({"model_type": layout, "num_nextn_predict_layers": 1,
                                                              "architectures": ["X"]}))
    loaded, _ = load_head(tmp_path / "pub", model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    ids, h, pos = torch.randint(0, V, (1, 5)), torch.randn(1, 5, H), torch.arange(5)[None]
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    with torch.no_grad():
        torch.testing.assert_close(loaded.logits(loaded.step(ids, h, pos, sdpa)), head.logits(head.step(ids, h, pos, sdpa)))


def test_qwen3_next_layout_on_a_tiny_qwen3_next_target(tmp_path):
    """Qwen3-Next (built by transformers on CPU): the MTP block is a full-attention MoE layer among linear-
    attention ones; the full-checkpoint export writes Qwen3-Next's own mtp.* names (published list), with
    per-expert tensors, and imports back to the same module."""
    from draftsmith.runtime.export import export_head
    config = AutoConfig.for_model("qwen3_next", vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_value_heads=4,
                                  linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                  max_position_embeddings=256)
    model = _target(config)
    head = _head(model, seed=9)
    block = head.modules_[0].block
    assert type(block).__name__ == "Qwen3NextDecoderLayer" and hasattr(block, "self_attn") and "Moe" in type(block.mlp).__name__
    target = _save_target(tmp_path, model)
    out = tmp_path / "full"
    export_head(str(_checkpoint(tmp_path, head, target)), "nextn-full", str(out), dtype="fp32", allow_unvalidated=True)
    names = set(load_file(str(out / "model-mtp.safetensors")))
    assert {n for n in names if ".experts." not in n} == set(PUBLISHED["qwen3_next"]["mtp_tensors"])
    assert {n for n in names if ".experts." in n} == {f"mtp.layers.0.mlp.experts.{e}.{p}.weight" for e in range(4)
                                                      for p in ("gate_proj", "up_proj", "down_proj")}
    loaded, _ = load_head(out, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    ids, h, pos = torch.randint(0, V, (1, 5)), torch.randn(1, 5, 64), torch.arange(5)[None]
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    with torch.no_grad():
        torch.testing.assert_close(loaded.logits(loaded.step(ids, h, pos, sdpa)), head.logits(head.step(ids, h, pos, sdpa)))


@pytest.mark.slow
def test_transformers_mtp_generation_reads_the_nextn_full_export_and_drafts_what_we_draft(tmp_path, monkeypatch):
    """transformers' own MTP decoding (`generate(use_mtp=True)`) on the nextn-full export: it finds the module through the
    index the export writes and gives our output. Its one difference in rule, the embedding at position 0 kept where
    vLLM zeroes it (and so do we), changes the drafts' logits a little (argmax the same here); with that rule set as
    transformers' it drafts in every round the logits our drafter drafts from the same context. The target has 61
    layers because transformers looks for DeepSeek-V3's module at model.layers.61 only."""
    from transformers.modeling_layers import MtpModel
    from draftsmith.runtime.export import export_head
    model = _target(deepseek_v3(layers=61))
    head = _head(model)
    ckpt = _checkpoint(tmp_path, head, _save_target(tmp_path, model))
    export_head(str(ckpt), "nextn-full", str(tmp_path / "full"), dtype="fp32", allow_unvalidated=True)
    index = json.loads((tmp_path / "full" / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.61.eh_proj.weight"] == "model-mtp.safetensors" and not (tmp_path / "full" / "model.safetensors").exists()
    theirs, ours = [], []
    forward = MtpModel.forward

    def recorded(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        theirs.append(out[1][0, -1].float())
        return out
    monkeypatch.setattr(MtpModel, "forward", recorded)
    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(3))
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "full").eval()
    with torch.no_grad():
        out = full.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=20,
                            use_mtp=True, do_sample=False, pad_token_id=0)
    for zero_first in (True, False):
        ours.clear()
        head.zero_first_embedding = zero_first
        drafter = MTPDrafter(head, 96, TreeConfig(1, 1, 2))
        draft_tree = drafter.draft_tree
        drafter.draft_tree = lambda root, d=drafter, f=draft_tree: ours.append(d.logits_last[0].float().clone()) or f(root)
        spec = speculative_generate(TargetRunner(model, 96, []), drafter, prompt, 20, GREEDY, set())
        assert out[0, len(prompt):].tolist() == spec.tokens
        assert len(ours) > 10 and len(theirs) >= len(ours) - 1
        gap = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
        assert (gap > 1e-3) if zero_first else (gap < 1e-5), gap
