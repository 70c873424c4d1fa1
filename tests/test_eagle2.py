"""EAGLE-2 heads: the published EAGLE-1 layout and parameter count, the loss against an explicit
EAGLE-1 reference, training-time test, drafting (exact greedy, lossless sampling), engine exports
read back by an independent implementation written from the engines' rules, import of published heads."""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from conftest import target_config, two_token_total_variation

from draftsmith.heads.drafting import TreeConfig
from draftsmith.heads.eagle2 import formats
from draftsmith.heads.eagle2.draft import Eagle2Drafter
from draftsmith.heads.eagle2.loss import eagle2_loss
from draftsmith.heads.eagle2.model import Eagle2Head, draft_config_from_target
from draftsmith.heads.loading import load_head
from draftsmith.heads.registry import head_spec
from draftsmith.recipe import HeadConfig
from draftsmith.runtime.generate import plain_generate, speculative_generate
from draftsmith.runtime.target import TargetRunner
from draftsmith.runtime.verify import SamplingConfig

FIXTURES = Path(__file__).parent / "fixtures"
LAYOUTS = json.loads((FIXTURES / "published_eagle1_layouts.json").read_text())
GREEDY = SamplingConfig()
V = 96


# ---------------------------------------------------------------- the published layout


@pytest.mark.parametrize("layout,target", [
    ("eagle1__yuhuili__EAGLE-LLaMA3-Instruct-8B", "meta-llama/Meta-Llama-3-8B-Instruct"),
    ("eagle1__yuhuili__EAGLE-Vicuna-7B-v1.3", "lmsys/vicuna-7b-v1.3"),
])
def test_names_and_shapes_match_published_eagle1_heads(layout, target):
    """fc bias by default as the family's published heads: none for Llama-3, EAGLE's bias for Vicuna."""
    with torch.device("meta"):
        head = head_spec("eagle2").model.from_target(target_config(target), HeadConfig(kind="eagle2"), [])
    ours = {k: list(v.shape) for k, v in head.trainable_state().items()}
    published = {k: v["shape"] for k, v in LAYOUTS[layout]["tensors"].items() if k != "embed_tokens.weight"}
    assert ours == published
    assert head.config["bias"] == LAYOUTS[layout]["config"].get("bias", True)


def test_trainable_parameters_for_llama3_8b_match_reference_count():
    with torch.device("meta"):
        head = Eagle2Head.from_target(target_config("meta-llama/Meta-Llama-3-8B-Instruct"), HeadConfig(kind="eagle2"), [])
    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    assert abs(trainable - 251.7e6) / 251.7e6 < 0.001    # REFERENCE: 251.7M (README: 0.25B)
    assert not head.embed_tokens.weight.requires_grad and not head.lm_head.weight.requires_grad
    assert isinstance(head.layers[0].input_layernorm, torch.nn.Identity)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_the_decoder_layer_is_the_target_familys(arch):
    config = AutoConfig.for_model(arch, vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    head = Eagle2Head.from_target(config, HeadConfig(kind="eagle2", layer="target"), [])
    assert type(head.layers[0]).__name__.lower().startswith(arch)
    names = set(head.trainable_state())
    assert ("layers.0.self_attn.q_proj.bias" in names) == (arch == "qwen2")      # Qwen2's qkv bias
    assert ("layers.0.self_attn.q_norm.weight" in names) == (arch == "qwen3")    # Qwen3's q/k norms


@pytest.mark.parametrize("arch, default", [("llama", "llama"), ("mistral", "mistral"), ("qwen2", "qwen2"),
                                           ("qwen3", "llama"), ("gemma", "llama"), ("phi3", "llama")])
def test_the_default_draft_layer_is_one_an_engine_holds(arch, default):
    """No engine's EAGLE-1 class holds a Qwen3, Gemma or Phi layer: those targets get a Llama layer of
    their sizes (SiLU, no biases), as the EAGLE reference builds; head.layer overrides either way."""
    config = AutoConfig.for_model(arch, vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    head = Eagle2Head.from_target(config, HeadConfig(kind="eagle2"), [])
    assert head.config["model_type"] == default and head.config["draftsmith"]["target_model_type"] == arch
    assert type(head.layers[0]).__name__.lower().startswith(default)
    assert head.layers[0].self_attn.q_proj.weight.shape == (4 * 16, 32)          # the target's head_dim kept
    llama = Eagle2Head.from_target(config, HeadConfig(kind="eagle2", layer="llama"), [])
    assert type(llama.layers[0]).__name__ == "LlamaDecoderLayer" and llama.config["hidden_act"] == "silu"
    with pytest.raises(ValueError, match="head.layer='gpt2'"):
        Eagle2Head.from_target(config, HeadConfig(kind="eagle2", layer="gpt2"), [])


# ---------------------------------------------------------------- the loss


def _tiny_head(steps=1, seed=0, **kwargs):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=4, max_position_embeddings=256)
    head = Eagle2Head(draft_config_from_target(config, fc_bias=True), ttt_steps=steps, **kwargs)
    head.load_target_weights(torch.randn(V, 32), torch.randn(V, 32) * 0.3)
    return head


def _batch(B=2, T=10, H=32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(B, T, H, generator=gen)
    valid = torch.rand(B, T, generator=gen) > 0.3
    return {"input_ids": torch.randint(0, V, (B, T), generator=gen), "aux": features,
            "position_ids": torch.arange(T).expand(B, T), "target_probs": torch.softmax(torch.randn(B, T, V, generator=gen), -1),
            "target_valid": valid, "target_argmax": torch.randint(0, V, (B, T), generator=gen)}


def test_one_step_loss_is_eagle1s_objective():
    """k = 1 against EAGLE-1 written out: fc over cat(embed(x_{t+1}), f_t), the layer with plain causal
    attention, SmoothL1 to f_{t+1} (mean over features) + 0.1 soft CE, over masked positions."""
    head, batch = _tiny_head().eval(), _batch()
    loss, metrics = eagle2_loss(head, batch)
    ids, f = batch["input_ids"], batch["aux"]
    x = head.fc(torch.cat([head.embed_tokens(ids[:, 1:]), f[:, :-1]], -1))
    cos, sin = head.rotary(x, batch["position_ids"][:, :-1])
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    h = head.layers[0](x, position_embeddings=(cos, sin), attend=sdpa)
    mask = batch["target_valid"][:, 1:].float()
    vloss = F.smooth_l1_loss(h, f[:, 1:], reduction="none").mean(-1)
    ploss = -(batch["target_probs"][:, 1:] * torch.log_softmax(head.lm_head(h), -1)).sum(-1)
    expected = ((vloss + 0.1 * ploss) * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert set(metrics) >= {"loss_0", "feature_loss_0", "token_loss_0", "acc_0", "sim_accept_len"}


def test_input_noise_only_in_training_and_scaled_by_length():
    head, batch = _tiny_head(input_noise=0.2), _batch(T=16)
    head.eval()
    assert eagle2_loss(head, batch)[0] == eagle2_loss(head, batch)[0]   # no noise at eval
    head.train()
    torch.manual_seed(0)
    noisy = eagle2_loss(head, batch)[0]
    assert noisy != eagle2_loss(head.eval(), batch)[0]
    from draftsmith.heads.eagle2.loss import input_noise
    x = torch.zeros(1, 512, 4)
    assert input_noise(x, 0.2).abs().max() <= 0.1 and input_noise(x, 0.2).abs().max() > 0.09  # U(-0.1, 0.1) at T=512


def test_unrolled_steps_decay_and_feed_own_predictions():
    batch = _batch(T=12)
    one, _ = eagle2_loss(_tiny_head(steps=1).eval(), batch)
    three, metrics = eagle2_loss(_tiny_head(steps=3).eval(), batch)
    assert torch.isclose(metrics["loss_0"], one)
    torch.testing.assert_close(three, metrics["loss_0"] + 0.8 * metrics["loss_1"] + 0.64 * metrics["loss_2"])


def test_head_learns_a_batch_with_ttt():
    head, batch = _tiny_head(steps=2, seed=3), _batch(B=2, T=12, seed=4)
    batch["target_valid"][:] = True
    batch["target_probs"] = torch.softmax(torch.randn(2, 12, V, generator=torch.Generator().manual_seed(5)) * 6, -1)
    batch["target_argmax"] = batch["target_probs"].argmax(-1)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(150):
        loss, metrics = eagle2_loss(head, batch)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.5 * first and metrics["acc_0"] > 0.7 and metrics["acc_1"] > 0.5  # chance: 1/96; a frozen random lm_head cannot reach every argmax


# ---------------------------------------------------------------- drafting in the runtime


@pytest.fixture(scope="module")
def tiny_target():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    return model, TargetRunner(model, 256, [])   # no layer ids: the runner returns the final hidden state


def random_head(model, seed=0):
    torch.manual_seed(seed)
    head = Eagle2Head(draft_config_from_target(model.config)).eval()
    head.load_target_weights(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return head


@pytest.mark.parametrize("depth,top_k,nodes", [(1, 1, 2), (5, 1, 6), (3, 2, 6), (4, 4, 16), (5, 8, 40)])
def test_greedy_speculative_equals_plain_greedy(tiny_target, depth, top_k, nodes):
    model, runner = tiny_target
    drafter = head_spec("eagle2").drafter(random_head(model, seed=depth), 256, TreeConfig(depth, top_k, nodes))
    for seed in range(4):
        prompt = torch.randint(0, V, (3 + 5 * seed,), generator=torch.Generator().manual_seed(seed))
        base = plain_generate(runner, prompt, 32, GREEDY, set())
        assert speculative_generate(runner, drafter, prompt, 32, GREEDY, set()).tokens == base.tokens


def test_chain_drafting_builds_the_dynamic_tree_with_top_k_1(tiny_target):
    model, runner = tiny_target
    drafter = Eagle2Drafter(random_head(model, seed=11), 256, TreeConfig(5, 1, 6))
    prompt = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(3))
    runner.reset()
    _, features, _ = runner.prefill(prompt)
    drafter.reset()
    drafter.extend(prompt[1:], features[:-1])
    chain, general = drafter.draft_chains(prompt[-1:])[0], drafter.draft_dynamic(prompt[-1:])[0]
    for key in ("tokens_N", "parent_N", "depth_N", "mask_NN"):
        assert torch.equal(getattr(chain, key), getattr(general, key)), key


def test_sampled_speculative_matches_plain_sampling_on_model(tiny_target):
    """Distribution of the first two generated tokens, speculative vs the target's own exact joint."""
    model, runner = tiny_target
    drafter = Eagle2Drafter(random_head(model, seed=3), 256, TreeConfig(3, 4, 10))
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    prompt = torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(11))
    tv, support_ok = two_token_total_variation(model, runner, drafter, prompt, cfg, num_samples=2000, seed=0)
    assert support_ok and tv < 0.06


# ---------------------------------------------------------------- engine formats


def _self_distilled_head(model, steps=200):
    """A head trained on the tiny target's own greedy continuations, so acceptance is not trivial."""
    torch.manual_seed(0)
    runner = TargetRunner(model, 256, [])
    seqs = []
    for seed in range(8):
        prompt = torch.randint(0, V, (4,), generator=torch.Generator().manual_seed(100 + seed))
        seqs.append(torch.cat([prompt, torch.tensor(plain_generate(runner, prompt, 28, GREEDY, set()).tokens)]))
    ids = torch.stack(seqs)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    features, logits = out.hidden_states[-1], out.logits.float()
    batch = {"input_ids": ids, "aux": features, "position_ids": torch.arange(ids.shape[1]).expand_as(ids),
             "target_probs": torch.softmax(logits, -1), "target_valid": torch.ones_like(ids, dtype=torch.bool),
             "target_argmax": logits.argmax(-1)}
    head = random_head(model).train()
    head.ttt_steps = 2
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=2e-3)
    for _ in range(steps):
        loss, _ = eagle2_loss(head, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="module")
def exported(tiny_target, tmp_path_factory):
    """The distilled head exported for each engine (fp32), as config.json + model.safetensors."""
    model, _ = tiny_target
    head = _self_distilled_head(model)
    out = {}
    for engine, adapter in formats.ADAPTERS.items():
        config, tensors = adapter(head.trainable_state(), head.draft_config(), "fp32")
        path = tmp_path_factory.mktemp(engine)
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(config))
        out[engine] = path
    return head, out


def test_exports_follow_the_engines_rules(exported):
    head, paths = exported
    sg, vl = (json.loads((paths[e] / "config.json").read_text()) for e in ("sglang", "vllm"))
    sg_t, vl_t = load_file(paths["sglang"] / "model.safetensors"), load_file(paths["vllm"] / "model.safetensors")
    assert sg["architectures"] == ["LlamaForCausalLMEagle"] and sg["num_hidden_layers"] == 1
    assert vl["architectures"] == ["LlamaForCausalLM"] and vl["model_type"] == "llama"
    assert "bias" not in vl and "bias" not in sg and vl["dtype"] == vl["torch_dtype"] == "float32"
    published = set(LAYOUTS["eagle1__yuhuili__EAGLE-LLaMA3-Instruct-8B"]["tensors"]) - {"embed_tokens.weight"}
    assert set(vl_t) == published                             # the yuhuili Llama-3 layout exactly
    assert set(sg_t) == published | {"fc.bias"} and not sg_t["fc.bias"].any()   # SGLang's fc always has a bias
    assert not any("input_layernorm" in k or k.startswith(("embed", "lm_head")) for k in sg_t)
    assert "draft_vocab_size" not in sg and "draft_vocab_size" not in vl


def test_vllm_export_refuses_a_biased_head():
    head = _tiny_head()
    with torch.no_grad():
        head.fc.bias.fill_(0.1)
    with pytest.raises(ValueError, match="head.fc_bias=false"):
        formats.to_vllm(head.trainable_state(), head.draft_config(), "bf16")


def _independent_chain_decode(model, export_dir: Path, prompt: torch.Tensor, max_new: int, depth: int):
    """EAGLE-1 chain decoding written from the engines' rules, sharing nothing with draftsmith: the
    target by HF forward (no cache), the head from the exported files with plain torch ops
    (fc over cat(embed, feature); Llama layer without input norm; RoPE; GQA; SiLU MLP; the target's
    lm_head). Returns (tokens, accepted draft tokens per round)."""
    cfg = json.loads((export_dir / "config.json").read_text())
    w = load_file(export_dir / "model.safetensors")
    H, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or H // heads
    embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]))

    def rope(x, pos):
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        ang = pos[:, None].float() * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    def head_forward(tokens, feats):  # all positions at once, causal
        x = torch.cat([embed[tokens], feats], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
        T, pos = len(tokens), torch.arange(len(tokens))
        q = rope((x @ w["layers.0.self_attn.q_proj.weight"].T).view(T, heads, d).transpose(0, 1), pos)
        k = rope((x @ w["layers.0.self_attn.k_proj.weight"].T).view(T, kv, d).transpose(0, 1), pos)
        v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(T, kv, d).transpose(0, 1)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d) + torch.full((T, T), float("-inf")).triu(1)
        h = x + (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(T, heads * d) @ w["layers.0.self_attn.o_proj.weight"].T
        m = rms(h, w["layers.0.post_attention_layernorm.weight"])
        mlp = (F.silu(m @ w["layers.0.mlp.gate_proj.weight"].T) * (m @ w["layers.0.mlp.up_proj.weight"].T))
        return h + mlp @ w["layers.0.mlp.down_proj.weight"].T

    seq, accepted = prompt.tolist(), []
    with torch.no_grad():
        root = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        emitted = [root]
        while len(emitted) < max_new:
            feats = model(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]  # f_t pairs with x_{t+1}
            tokens, chain = seq[1:] + [root], []
            for _ in range(depth):   # the head re-reads its own predicted feature at each new position
                h = head_forward(torch.tensor(tokens), feats)
                chain.append(int((h[-1] @ lm_head.T).argmax()))
                tokens, feats = tokens + [chain[-1]], torch.cat([feats, h[-1:]])
            check = model(torch.tensor([seq + [root] + chain])).logits[0, len(seq):].argmax(-1).tolist()
            n = 0
            while n < depth and chain[n] == check[n]:
                n += 1
            accepted.append(n)
            seq, root = seq + [root] + chain[:n], check[n]
            emitted += chain[:n] + [root]
    return emitted[:max_new], accepted


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_exported_head_decoded_independently_matches_the_runtime(tiny_target, exported, engine):
    model, runner = tiny_target
    head, paths = exported
    back, meta = load_head(paths[engine], model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    assert meta["kind"] == "eagle2" and back.config["bias"] is False
    depth = 4
    drafter = Eagle2Drafter(back, 256, TreeConfig(depth, 1, depth + 1))
    total_accepted = 0
    for seed in range(3):
        prompt = torch.randint(0, V, (4,), generator=torch.Generator().manual_seed(100 + seed))
        plain = plain_generate(runner, prompt, 20, GREEDY, set()).tokens
        ours = speculative_generate(runner, drafter, prompt, 20, GREEDY, set())
        theirs, accepted = _independent_chain_decode(model, paths[engine], prompt, 20, depth)
        assert ours.tokens == plain == theirs
        n = len(ours.accept_lengths)
        assert ours.accept_lengths[:n - 1] == accepted[:n - 1]   # the last round may be cut by the token limit
        total_accepted += sum(accepted)
    assert total_accepted > 0                                     # the distilled head is right some of the time


@pytest.fixture(scope="module")
def qwen3_target():
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                                  eos_token_id=None, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config).eval()
    return model, TargetRunner(model, 256, [])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_llama_draft_layer_on_a_qwen3_target_is_served_by_both_engines(qwen3_target, engine, tmp_path):
    """A Qwen3 target gets a Llama draft layer by default: exported for each engine's Llama EAGLE class,
    read back, and decoded from the exported files by the independent decoder with the runtime's tau."""
    model, runner = qwen3_target
    head = _self_distilled_head(model, steps=150)
    assert head.config["model_type"] == "llama" and type(head.layers[0]).__name__ == "LlamaDecoderLayer"
    config, tensors = formats.ADAPTERS[engine](head.trainable_state(), head.draft_config(), "fp32")
    assert config["architectures"] == [{"sglang": "LlamaForCausalLMEagle", "vllm": "LlamaForCausalLM"}[engine]]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    back, _ = load_head(tmp_path, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    assert back.config["model_type"] == "llama" and back.config["draftsmith"]["target_model_type"] == "qwen3"
    depth, ours_accepted, theirs_accepted = 4, [], []
    drafter = Eagle2Drafter(back, 256, TreeConfig(depth, 1, depth + 1))
    for seed in range(3):
        prompt = torch.randint(0, V, (4,), generator=torch.Generator().manual_seed(100 + seed))
        ours = speculative_generate(runner, drafter, prompt, 20, GREEDY, set())
        theirs, accepted = _independent_chain_decode(model, tmp_path, prompt, 20, depth)
        assert ours.tokens == plain_generate(runner, prompt, 20, GREEDY, set()).tokens == theirs
        n = len(ours.accept_lengths)
        ours_accepted += ours.accept_lengths[:n - 1]
        theirs_accepted += accepted[:n - 1]
    assert ours_accepted == theirs_accepted and sum(ours_accepted) > 0   # the same tau, and not a trivial one


def test_export_skips_formats_that_cannot_serve_the_head_unless_asked_for(qwen3_target, tmp_path):
    """`draftsmith run` (no --to, no export.formats) writes the formats that apply and lists the others as
    skipped with the reason; an explicit --to that cannot be served still stops with that message."""
    import argparse
    from draftsmith import artifacts
    from draftsmith.heads.hf_layout import NotServable
    from draftsmith.stages import stage_export
    model, _ = qwen3_target
    head = Eagle2Head(draft_config_from_target(model.config, layer="target"))     # a Qwen3 layer: no engine class
    meta = {"kind": "eagle2", "target_id": "qwen3-target", "layer_ids": [], "draft_config": head.config, "step": 1}
    artifacts.save_checkpoint(tmp_path / "head", head.trainable_state(), meta)
    args = argparse.Namespace(head=str(tmp_path / "head"), allow_unvalidated=True, engine=None, out=None)
    written = stage_export(None, args)
    assert set(written) == {"skipped"} and set(written["skipped"]) == {"sglang", "vllm"}
    assert all("head.layer=llama" in why for why in written["skipped"].values())
    with pytest.raises(NotServable, match="head.layer=llama"):
        stage_export(None, argparse.Namespace(**vars(args) | {"engine": "sglang"}))


def test_published_eagle1_layout_imports_for_validation_and_fine_tuning(tiny_target, exported, tmp_path):
    """A yuhuili-style directory (pytorch_model.bin with the embedding stored and fc.bias, LlamaForCausalLM
    config with `bias`) loads through the registry; `head.init_from` starts training from it."""
    model, runner = tiny_target
    head, _ = exported
    state = dict(head.trainable_state())
    state["fc.bias"] = torch.randn(state["fc.weight"].shape[0]) * 0.01
    state["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
    torch.save(state, tmp_path / "pytorch_model.bin")
    published = dict(LAYOUTS["eagle1__yuhuili__EAGLE-Vicuna-7B-v1.3"]["config"])
    published.update(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=V)
    (tmp_path / "config.json").write_text(json.dumps(published))
    back, meta = load_head(tmp_path, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    assert meta["source_format"] == "eagle1" and back.config["bias"] is True
    torch.testing.assert_close(back.fc.bias, state["fc.bias"])
    drafter = Eagle2Drafter(back, 256, TreeConfig(3, 1, 4))
    prompt = torch.randint(0, V, (5,))
    assert speculative_generate(runner, drafter, prompt, 16, GREEDY, set()).tokens == plain_generate(runner, prompt, 16, GREEDY, set()).tokens
    published["hidden_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(published))
    with pytest.raises(ValueError, match="hidden_size=64 but the target has 48"):
        load_head(tmp_path, model.config)


# ---------------------------------------------------------------- through the stages


@pytest.mark.slow
def test_pipeline_offline_and_online_then_validate_and_export(tmp_path, micro_target):
    """data -> capture (final hidden, fp32) -> the one trainer -> validate -> export, for head.kind=eagle2;
    online mode gives the offline first loss (same extractor); an exported head validates exactly."""
    from conftest import micro_recipe
    from draftsmith.data.capture import run_capture
    from draftsmith.data.prepare import run_data
    from draftsmith.heads.registry import capture_needs
    from draftsmith.runtime.export import export_head
    from draftsmith.runtime.validate import run_validate
    from draftsmith.train.run import build_trainer, run_train
    from draftsmith.train.trainer import head_dir
    args = ["head.kind=eagle2", "head.ttt_steps=2", "data.max_conversations=60", "capture.dtype=fp32", "train.max_steps=6",
            "train.save_every=3"]
    recipe = micro_recipe(tmp_path / "off", micro_target, *args)
    run_data(recipe)
    manifest = run_capture(recipe, capture_needs("eagle2"))
    assert manifest["feature"] == "final" and manifest["head_kind"] == "eagle2"
    online = micro_recipe(tmp_path / "on", micro_target, *args, "capture.mode=online")
    run_data(online)
    a, b = build_trainer(recipe), build_trainer(online)
    assert a.vocab_report["draft_vocab_size"] == a.accelerator.unwrap_model(a.model).config["vocab_size"]
    la, lb = (t.train_step(next(t.micro_batches())) for t in (a, b))
    assert float(la["loss"]) == pytest.approx(float(lb["loss"]), rel=1e-4)
    assert {"feature_loss_0", "token_loss_1", "acc_1", "sim_accept_len"} <= set(la)
    manifest = run_train(recipe)
    tensors, meta = __import__("draftsmith.artifacts", fromlist=["x"]).load_checkpoint(head_dir(recipe))
    assert meta["kind"] == "eagle2" and manifest["steps"] == 6
    assert "lm_head.weight" not in tensors and "embed_tokens.weight" not in tensors and "fc.weight" in tensors
    summary = run_validate(recipe)
    assert summary["exact_match"] and summary["passed"]
    for engine in ("sglang", "vllm"):
        out = export_head(str(head_dir(recipe)), engine, str(tmp_path / engine))
        assert out["validated"] and ("--speculative-algorithm EAGLE " in out["serve"] or '"method": "eagle"' in out["serve"])
    back = run_validate(recipe, head=str(tmp_path / "vllm"), out=str(tmp_path / "val"))
    assert back["exact_match"]
