"""EAGLE 3.1's options (`fc_norm`, `norm_output`) and the acceptance-rate (LK) losses: each against its definition,
through training, the runtime (exact) and the engines' configs, and on every kind with a vocabulary loss."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import micro_recipe
from draftsmith.heads.drafting import TreeConfig
from draftsmith.heads.eagle3.draft import Eagle3Drafter
from draftsmith.heads.eagle3.formats import import_layout, to_sglang, to_speculators, to_vllm
from draftsmith.heads.eagle3.model import Eagle3Head
from draftsmith.heads.objective import position_loss, soft_ce_sums
from draftsmith.heads.ttt import shift_left
from draftsmith.recipe import HeadConfig
from draftsmith.runtime.generate import plain_generate, speculative_generate
from draftsmith.runtime.target import TargetRunner
from draftsmith.runtime.verify import SamplingConfig

V, H = 50, 32


def _target_config():
    return LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=7, num_attention_heads=4,
                       num_key_value_heads=2)


def _head(steps=2, **options):
    head = Eagle3Head.from_target(_target_config(), HeadConfig(draft_vocab_size=V, ttt_steps=steps, **options), [2, 3, 4])
    head.set_vocab(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    return head


def _batch(B=2, T=10):
    probs = torch.softmax(torch.randn(B, T, V) * 3, -1)
    return {"input_ids": torch.randint(0, V, (B, T)), "position_ids": torch.arange(T).expand(B, T),
            "aux": torch.randn(B, T, 3 * H) * torch.tensor([1.0, 10.0, 100.0]).repeat_interleave(H),
            "target_probs": probs, "target_valid": torch.ones(B, T, dtype=torch.bool), "target_argmax": probs.argmax(-1)}


# ---------------------------------------------------------------- LK losses


def test_lk_losses_follow_their_definitions():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6, V) * 2, -1)
    logq = torch.log_softmax(torch.randn(6, V), -1)
    q = logq.exp()
    accept = torch.minimum(p, q).sum(-1)
    torch.testing.assert_close(position_loss(p, logq, "lk_alpha"), -accept.log())
    kl = (p * (p.log() - logq)).sum(-1)
    lam = 2.0 * torch.exp(-3.0 * accept)
    torch.testing.assert_close(position_loss(p, logq, "lk_lambda", 2.0, 3.0), lam * kl + (1 - lam) * (1 - accept))
    torch.testing.assert_close(position_loss(p, logq, "soft_ce"), -(p * logq).sum(-1))
    # where the draft equals the teacher, every position is accepted: alpha and lambda losses vanish
    assert position_loss(p, p.log(), "lk_alpha").abs().max() < 1e-5
    assert position_loss(p, p.log(), "lk_lambda").abs().max() < 1e-5
    with pytest.raises(ValueError, match="head.objective='kl'.*soft_ce"):
        position_loss(p, logq, "kl")


def test_lambda_is_detached_and_blocks_equal_the_whole():
    """lambda carries no gradient (a detached), and the position-blocked, checkpointed path gives the whole
    loss and gradients for the LK objectives too."""
    torch.manual_seed(1)
    lm = torch.nn.Linear(8, V)
    h = torch.randn(2, 12, 8, requires_grad=True)
    probs = torch.softmax(torch.randn(2, 12, V), -1)
    mask = torch.ones(2, 12, dtype=torch.bool)
    argmax = probs.argmax(-1)
    for objective in (("lk_alpha", 1.0, 1.0), ("lk_lambda", 1.0, 3.0)):
        whole, _ = soft_ce_sums(lm, h, probs, 0, mask, argmax, objective=objective)
        g_whole = torch.autograd.grad(whole, h)[0]
        blocked, _ = soft_ce_sums(lm, h, probs, 0, mask, argmax, budget=3 * 2 * V, objective=objective)
        g_blocked = torch.autograd.grad(blocked, h)[0]
        torch.testing.assert_close(whole, blocked)
        torch.testing.assert_close(g_whole, g_blocked)
    p, logq = probs[0], torch.log_softmax(torch.randn(12, V, requires_grad=True), -1)
    accept = torch.minimum(p, logq.exp()).sum(-1)
    kl = (p * (p.log() - logq)).sum(-1)
    lam = torch.exp(-accept.detach())
    expected = torch.autograd.grad((lam * kl + (1 - lam) * (1 - accept)).sum(), logq, retain_graph=True)[0]
    got = torch.autograd.grad(position_loss(p, logq, "lk_lambda").sum(), logq)[0]
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("objective", ["lk_alpha", "lk_lambda"])
def test_an_eagle3_head_overfits_a_batch_with_an_lk_loss(objective):
    torch.manual_seed(0)
    head, batch = _head(steps=2), _batch(T=8)
    head.objective = (objective, 1.0, 1.0)
    batch["target_probs"] = torch.nn.functional.one_hot(batch["target_argmax"], V).float() * 0.9 + 0.1 / V
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(100):
        loss, metrics = head(batch)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first and metrics["acc_0"] > 0.9


# ---------------------------------------------------------------- EAGLE 3.1 options


def test_fc_norm_normalizes_each_feature_before_fc():
    torch.manual_seed(0)
    head = _head(fc_norm=True)
    assert [n for n, _ in head.named_parameters() if n.startswith("fc_norm")] == [f"fc_norm.{i}.weight" for i in range(3)]
    batch = _batch()
    with torch.no_grad():
        for i, norm in enumerate(head.fc_norm):
            norm.weight.copy_(torch.rand(H) + 0.5)
        parts = batch["aux"].chunk(3, -1)
        expected = head.fc(torch.cat([n(p) for n, p in zip(head.fc_norm, parts)], -1))
        torch.testing.assert_close(head.project(batch["aux"]), expected)
        # feature scales 1, 10, 100 no longer matter: scaling one feature leaves the projection unchanged
        scaled = batch["aux"].clone()
        scaled[..., 2 * H:] *= 7
        torch.testing.assert_close(head.project(scaled), expected, atol=1e-4, rtol=1e-4)
        plain = _head()
        assert not torch.allclose(plain.project(scaled), plain.project(batch["aux"]))  # without fc_norm it does


def test_norm_output_feeds_the_normed_state_to_lm_head_and_the_next_step():
    torch.manual_seed(0)
    plain, normed = _head(), _head(norm_output=True)
    normed.load_state_dict(plain.state_dict())
    batch = _batch()
    attend = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ids, h0 = shift_left(batch["input_ids"], 1), plain.project(batch["aux"])
    with torch.no_grad():
        out_plain, out_normed = plain.step(ids, h0, batch["position_ids"], attend), normed.step(ids, h0, batch["position_ids"], attend)
        torch.testing.assert_close(out_normed, plain.norm(out_plain))
        torch.testing.assert_close(normed.logits(out_normed), plain.logits(out_plain))  # the same first-step logits
        second_plain = plain.step(ids, out_plain, batch["position_ids"] + 1, attend)
        second_normed = normed.step(ids, out_normed, batch["position_ids"] + 1, attend)
        assert not torch.allclose(normed.logits(second_normed), plain.logits(second_plain))  # the next step reads another state


def test_eagle31_heads_decode_exactly_and_export_what_the_engines_read(tmp_path):
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=7,
                                          num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)).eval()
    head = _head(fc_norm=True, norm_output=True).eval()
    head.load_target_weights(target.get_input_embeddings().weight)
    runner = TargetRunner(target, 128, [2, 3, 4])
    drafter = Eagle3Drafter(head, 128, TreeConfig(3, 2, 6))
    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(2))
    base = plain_generate(runner, prompt, 24, SamplingConfig(), set())
    assert speculative_generate(runner, drafter, prompt, 24, SamplingConfig(), set()).tokens == base.tokens
    tensors = head.trainable_state()
    for adapter in (to_sglang, to_vllm):
        config, out = adapter(tensors, head.config, "fp32")
        assert config["fc_norm"] is True and config["norm_output"] is True
        assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(out)
    config, _ = to_speculators(tensors, head.config, "fp32")
    assert config["fc_norm"] is True and config["norm_output"] is True
    # an exported directory imports back with its options and tensors
    from safetensors.torch import save_file
    config, out = to_sglang(tensors, head.config, "fp32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in out.items()}, str(tmp_path / "model.safetensors"))
    ours, names, _ = import_layout(tmp_path, config, _target_config())
    assert ours["fc_norm"] and ours["norm_output"]
    back = Eagle3Head(ours)
    back.load_state_dict(names, strict=False)
    torch.testing.assert_close(back.fc_norm[1].weight, head.fc_norm[1].weight)


@pytest.mark.slow
def test_micro_pipeline_with_eagle31_and_lk_lambda(tmp_path, micro_target):
    """The whole pipeline with fc_norm, norm_output and the lambda LK loss: trains, validates exactly, exports the keys."""
    from draftsmith.stages import run_all
    recipe = micro_recipe(tmp_path, micro_target, "head.fc_norm=true", "head.norm_output=true", "head.objective=lk_lambda",
                          "train.max_steps=4", "validate.num_prompts=2", "validate.max_new_tokens=12")
    summary = run_all(recipe)
    assert "greedy exact: True" in summary
    config = json.loads((recipe.run_dir / "export" / "vllm" / "config.json").read_text())
    assert config["fc_norm"] and config["norm_output"]
    head = json.loads((recipe.run_dir / "head" / "head.json").read_text())
    assert "lk_lambda" in json.dumps(head)
