"""EAGLE-3 head: parameter names and shapes against published heads; training-time test semantics."""
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import target_config
from transformers import LlamaConfig

from draftsmith.heads.ttt import TTTAttention, shift_left
from draftsmith.heads.eagle3.model import Eagle3Head, draft_config_from_target
from draftsmith.heads.registry import get_head_class
from draftsmith.recipe import HeadConfig

FIXTURES = Path(__file__).parent / "fixtures"
LAYOUTS = json.loads((FIXTURES / "published_eagle3_layouts.json").read_text())


@pytest.mark.parametrize("layout,target", [
    ("eagle3__yuhuili__EAGLE3-LLaMA3.1-Instruct-8B", "meta-llama/Llama-3.1-8B-Instruct"),
    ("eagle3__lmsys__SGLang-EAGLE3-Llama-3.3-70B-Instruct-SpecForge", "meta-llama/Llama-3.3-70B-Instruct"),
])
def test_names_and_shapes_match_published_heads(layout, target):
    with torch.device("meta"):
        head = get_head_class("eagle3").from_target(target_config(target), HeadConfig(draft_vocab_size=32000), [2, 16, 29])
    ours = {k: list(v.shape) for k, v in head.trainable_state().items()}
    published = {k: v["shape"] for k, v in LAYOUTS[layout]["tensors"].items()}
    assert ours == published


def test_qwen3_head_uses_its_head_dim():
    with torch.device("meta"):
        head = Eagle3Head.from_target(target_config("Qwen/Qwen3-8B"), HeadConfig(), [2, 18, 33])
    assert head.midlayer.self_attn.q_proj.weight.shape == (32 * 128, 2 * 4096)
    assert head.lm_head.weight.shape == (32000, 4096) and head.t2d.shape == (151936,)


def test_trainable_parameters_for_llama8b_match_reference_count():
    with torch.device("meta"):
        head = Eagle3Head.from_target(target_config("meta-llama/Llama-3.1-8B-Instruct"), HeadConfig(), [2, 16, 29])
    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    assert abs(trainable - 425e6) / 425e6 < 0.01   # REFERENCE: ~425M trainable + a frozen 525M embedding
    assert not head.embed_tokens.weight.requires_grad


def test_llama3_rope_scaling_is_kept():
    cfg = draft_config_from_target(target_config("meta-llama/Llama-3.1-8B-Instruct"), 32000, [2, 16, 29])
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["rope_type"] == "llama3"


def test_unknown_head_kind_lists_valid_kinds():
    with pytest.raises(ValueError, match="valid kinds: dflash, eagle2, eagle3"):
        get_head_class("eagle9")


def _reference_ttt_attention(qs, ks, vs):
    """The pattern spelled out with a materialized mask: keys of step 0 causal, later steps diagonal."""
    q = qs[-1]
    T = q.shape[2]
    keys = torch.cat(ks, dim=2)
    values = torch.cat(vs, dim=2)
    allowed = torch.zeros(T, T * len(ks), dtype=torch.bool)
    allowed[:, :T] = torch.ones(T, T, dtype=torch.bool).tril()
    for j in range(1, len(ks)):
        allowed[:, j * T:(j + 1) * T] = torch.eye(T, dtype=torch.bool)
    keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], 1)
    values = values.repeat_interleave(q.shape[1] // values.shape[1], 1)
    scores = (q @ keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ values


def test_ttt_attention_equals_explicit_mask_reference():
    torch.manual_seed(0)
    attend, qs, ks, vs = TTTAttention(), [], [], []
    for i in range(4):
        q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
        qs.append(q), ks.append(k), vs.append(v)
        torch.testing.assert_close(attend.at(i)(q, k, v), _reference_ttt_attention(qs, ks, vs), atol=1e-5, rtol=1e-5)


def _tiny_head(steps=3):
    tc = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                     num_attention_heads=4, num_key_value_heads=2)
    head = Eagle3Head.from_target(tc, HeadConfig(draft_vocab_size=50, ttt_steps=steps), [2, 3, 4])
    head.set_vocab(torch.zeros(50, dtype=torch.long), torch.ones(50, dtype=torch.bool))
    return head


def _batch(B=2, T=10, V=50, H=32, valid=None):
    probs = torch.softmax(torch.randn(B, T, V) * 3, -1)
    return {"input_ids": torch.randint(0, V, (B, T)), "position_ids": torch.arange(T).expand(B, T),
            "aux": torch.randn(B, T, 3 * H), "target_probs": probs,
            "target_valid": torch.ones(B, T, dtype=torch.bool) if valid is None else valid,
            "target_argmax": probs.argmax(-1)}


def test_step0_loss_is_soft_cross_entropy_against_shifted_teacher():
    torch.manual_seed(0)
    head, batch = _tiny_head(steps=1), _batch()
    loss, metrics = head(batch)
    h = head.step(shift_left(batch["input_ids"], 1), head.fc(batch["aux"]), batch["position_ids"],
                  lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    logq = torch.log_softmax(head.logits(h[:, :-1]).float(), -1)
    expected = -(batch["target_probs"][:, 1:] * logq).sum(-1).mean()
    torch.testing.assert_close(loss, expected)
    assert set(metrics) >= {"loss_0", "acc_0", "sim_accept_len"}


def test_later_steps_decay_and_masked_positions_do_not_count():
    torch.manual_seed(0)
    head = _tiny_head(steps=3)
    batch = _batch()
    _, full = head(batch)
    masked = dict(batch, target_valid=batch["target_valid"].clone())
    masked["target_valid"][:, 5:] = False
    masked["target_probs"] = batch["target_probs"].clone()
    masked["target_probs"][:, 5:] = torch.softmax(torch.randn_like(masked["target_probs"][:, 5:]), -1)
    loss_a, _ = head(dict(batch, target_valid=masked["target_valid"]))
    loss_b, _ = head(masked)
    torch.testing.assert_close(loss_a, loss_b)  # teacher rows outside the mask are ignored
    total = sum(0.8 ** i * full[f"loss_{i}"] for i in range(3))
    torch.testing.assert_close(head(batch)[0], total)


def test_head_can_overfit_a_batch():
    torch.manual_seed(0)
    head, batch = _tiny_head(steps=2), _batch(T=8)
    batch["target_probs"] = torch.nn.functional.one_hot(batch["target_argmax"], 50).float()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(150):
        loss, metrics = head(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert metrics["acc_0"] > 0.95 and metrics["acc_1"] > 0.9


def test_import_rules():
    """recipe.py imports only typed_yaml.py, which imports nothing of ours; heads/ only heads, target and layer 1; data/ never heads/train;
    runtime/ never train/ (the whole rule set: test_layering.py)."""
    import ast
    root = Path(__file__).resolve().parent.parent / "draftsmith"

    def imports(path):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                if node.module == "draftsmith":  # `from draftsmith import artifacts`
                    names.update(f"draftsmith.{a.name}" for a in node.names)
                    names.discard("draftsmith")
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return {n for n in names if n.startswith("draftsmith")}

    assert imports(root / "recipe.py") == {"draftsmith.typed_yaml"} and imports(root / "typed_yaml.py") == set()
    for path in (root / "heads").rglob("*.py"):
        assert all(n.startswith(("draftsmith.heads", "draftsmith.targets", "draftsmith.recipe", "draftsmith.artifacts"))
                   for n in imports(path)), path
    for path in (root / "data").rglob("*.py"):
        assert not any(n.startswith(("draftsmith.heads", "draftsmith.train")) for n in imports(path)), path
    for path in (root / "runtime").rglob("*.py"):
        assert not any(n.startswith("draftsmith.train") for n in imports(path)), path


@pytest.mark.parametrize("model_type, extra", [
    ("cohere2", {"layer_norm_eps": 1e-5}), ("lfm2", {"norm_eps": 1e-5}), ("gpt_oss", {}), ("gemma3_text", {}),
    ("qwen3_next", {}), ("llama4_text", {})])
def test_head_config_from_targets_that_name_sizes_otherwise(model_type, extra):
    """A Llama draft layer for any target: sizes read under the target's own names, Llama defaults (listed)
    where it has none, SiLU whatever the target's MLP."""
    from transformers import AutoConfig
    config = AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  vocab_size=100, num_hidden_layers=4, **extra)
    cfg = draft_config_from_target(config, 50, [1, 2, 3])
    if extra:
        assert cfg["rms_norm_eps"] == next(iter(extra.values())) and "rms_norm_eps" not in cfg["draftsmith"]["defaults"]
    assert cfg["hidden_act"] == "silu" and cfg["draftsmith"]["target_model_type"] == model_type
    head = Eagle3Head(cfg)
    assert head.midlayer.self_attn.q_proj.weight.shape[0] == 4 * cfg["head_dim"]


def test_lm_head_can_start_from_the_targets_rows_of_the_draft_vocabulary():
    """head.lm_head_init: target: draft row i is the target's row d2t-mapped from i; random leaves it untouched."""
    tc = LlamaConfig(vocab_size=40, hidden_size=16, num_attention_heads=2, num_hidden_layers=5, intermediate_size=32)
    target_ids = torch.tensor([3, 7, 8, 20, 39])
    d2t, t2d = target_ids - torch.arange(5), torch.zeros(40, dtype=torch.bool)
    t2d[target_ids] = True
    embed, lm_head = torch.randn(40, 16), torch.randn(40, 16)
    for from_target in (True, False):
        torch.manual_seed(0)
        head = Eagle3Head.from_target(tc, HeadConfig(draft_vocab_size=5), [2, 3, 4])
        head.set_vocab(d2t, t2d)
        head.lm_head_from_target = from_target
        head.load_target_weights(embed, lm_head)
        assert torch.equal(head.lm_head.weight, lm_head[target_ids]) == from_target
        assert torch.equal(head.embed_tokens.weight, embed)
