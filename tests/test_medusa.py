"""Medusa-1 and Medusa-2: the published layouts, separate weights per layer, identity at init, the
decayed soft-CE objective, static and accuracy-built trees, exact greedy and lossless sampled
decoding with the heads' distributions as proposals, typical acceptance (lossy, labelled), engine
exports read back by loaders written from vLLM's and FasterDecoding's rules, import of published
heads, and the two pipelines end to end (joint LoRA training: stages, exact resume, drift, merged target)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import ROOT, micro_recipe, target_config, two_token_total_variation

from draftsmith import artifacts
from draftsmith.heads.drafting import TreeConfig
from draftsmith.heads.loading import load_head
from draftsmith.heads.medusa import formats
from draftsmith.heads.medusa.draft import MedusaDrafter
from draftsmith.heads.medusa.loss import medusa_loss
from draftsmith.heads.medusa.model import MedusaHead, draft_config_from_target
from draftsmith.heads.tree import StaticLayout, Tree, ancestor_mask, tree_from_accuracies
from draftsmith.recipe import HeadConfig, LoraJointConfig
from draftsmith.runtime.generate import plain_generate, speculative_generate
from draftsmith.runtime.target import TargetRunner
from draftsmith.runtime.verify import SamplingConfig, processed_probs, verify_sampling, verify_typical

FIXTURES = Path(__file__).parent / "fixtures"
PUBLISHED = json.loads((FIXTURES / "published_medusa_layouts.json").read_text())
GREEDY = SamplingConfig()
V, H = 96, 48


def _config(heads=4, layers=1, shared=False, lora=None):
    return draft_config_from_target(LlamaConfig(vocab_size=V, hidden_size=H, num_attention_heads=4), HeadConfig(
        kind="medusa", num_heads=heads, num_layers=layers, shared_lm_head=shared, lora=lora))


def _trained_like(head, seed=0, scale=0.05):
    """Random non-zero block weights, as after training."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith("blocks."):
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return head


# ---------------------------------------------------------------- the module and the published layouts


def test_exports_match_the_published_vicuna_7b_layouts():
    """5 heads x 1 layer for Vicuna-7B: vLLM's names (abhigoyal) plus the biases `medusa_fc_bias` announces,
    and FasterDecoding's names and shapes exactly."""
    with torch.device("meta"):
        head = MedusaHead.from_target(target_config("lmsys/vicuna-7b-v1.3"), HeadConfig(kind="medusa", num_heads=5), [])
    state = {k: torch.zeros(v.shape) for k, v in head.trainable_state().items()}
    vllm_cfg, vllm = formats.to_vllm(state, head.config, "bf16", "lmsys/vicuna-7b-v1.3")
    published = PUBLISHED["medusa__abhigoyal__vllm-medusa-vicuna-7b-v1.3"]
    ours = {k: list(v.shape) for k, v in vllm.items()}
    assert {k: v for k, v in ours.items() if not k.endswith(".bias")} == published["tensors"]
    assert all(ours[k] == [4096] for k in ours if k.endswith(".bias")) and vllm_cfg["medusa_fc_bias"] is True
    for key in ("architectures", "model_type", "hidden_size", "num_heads", "num_hidden_layers", "vocab_size"):
        assert vllm_cfg[key] == published["config"][key], key
    fd_cfg, fd = formats.to_fasterdecoding(state, head.config, "bf16", "lmsys/vicuna-7b-v1.3")
    published = PUBLISHED["medusa__FasterDecoding__medusa-vicuna-7b-v1.3"]
    assert {k: list(v.shape) for k, v in fd.items()} == published["tensors"]
    assert fd_cfg["medusa_num_layers"] == published["config"]["medusa_num_layers"] and fd_cfg["medusa_num_heads"] == 5


def test_each_layer_has_its_own_weights_and_a_fresh_head_is_the_targets_lm_head():
    """The reference's `[ResBlock] * n` shares one module across layers; ours does not. Zero-initialised
    blocks are the identity, and the lm_heads start as copies of the target's."""
    head = MedusaHead(_config(heads=3, layers=2), init_from_target=True)
    block = head.blocks[0]
    assert block.layers[0] is not block.layers[1] and block.layers[0].weight.data_ptr() != block.layers[1].weight.data_ptr()
    lm_head = torch.randn(V, H)
    head.load_target_weights(torch.randn(V, H), lm_head)
    f = torch.randn(2, 5, H)
    for k in range(3):
        torch.testing.assert_close(head.head_logits(f)[k], f @ lm_head.T)
    head.load_target_weights(torch.randn(V, H), torch.randn(V, H))  # only a fresh head is initialised from the target
    torch.testing.assert_close(head.lm_heads[0].weight, lm_head)
    shared = MedusaHead(_config(shared=True))
    assert "lm_head.weight" not in shared.trainable_state() and not shared.lm_head.weight.requires_grad


def test_loss_is_decayed_soft_ce_per_head_written_out():
    head = _trained_like(MedusaHead(_config(heads=3), loss_decay=0.8, init_from_target=True), seed=1)
    head.load_target_weights(None, torch.randn(V, H))
    gen = torch.Generator().manual_seed(2)
    B, T = 2, 9
    batch = {"aux": torch.randn(B, T, H, generator=gen), "target_probs": torch.softmax(torch.randn(B, T, V, generator=gen), -1),
             "target_valid": torch.rand(B, T, generator=gen) > 0.3, "target_argmax": torch.randint(0, V, (B, T), generator=gen)}
    loss, metrics = medusa_loss(head, batch)
    expected = 0
    for k in range(3):
        x = batch["aux"][:, :T - 1 - k]
        h = x + F.silu(x @ head.blocks[k].layers[0].weight.T + head.blocks[k].layers[0].bias)
        logits = h @ head.lm_heads[k].weight.T
        ce = -(batch["target_probs"][:, 1 + k:] * torch.log_softmax(logits, -1)).sum(-1)   # token t+2+k: teacher at t+1+k
        mask = batch["target_valid"][:, 1 + k:].float()
        expected = expected + 0.8 ** k * (ce * mask).sum() / mask.sum()
        top1 = ((logits.argmax(-1) == batch["target_argmax"][:, 1 + k:]) & mask.bool()).sum() / mask.sum()
        torch.testing.assert_close(metrics[f"top1_{k}"], top1)
        assert metrics[f"top5_{k}"] >= metrics[f"top1_{k}"]
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- trees


def test_accuracy_built_tree_is_greedy_by_expected_gain():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1]]
    # gains: [0]=.6, [0,0]=.3, [1]=.2, [0,1]=.12, [2]=.1, [1,0]=.1, ...
    assert tree_from_accuracies(acc, 5) == [[0], [0, 0], [1], [0, 1]]
    choices = tree_from_accuracies(acc, 8)
    assert len(choices) == 7 and all(c[:-1] in choices or len(c) == 1 for c in choices)  # ancestor-closed
    assert tree_from_accuracies([[0.6, 0.3], [0.2, 0.1]], 3) == [[0], [1]]
    assert tree_from_accuracies([[0.6, 0.3], [0.2, 0.1]], 3, spine=2) == [[0], [0, 0]]       # the rank-0 chain first
    assert tree_from_accuracies([[0.6, 0.3], [0.2, 0.05]], 5, spine=2) == [[0], [0, 0], [1], [1, 0]]
    layout = StaticLayout([[0], [2], [0, 1], [0, 3]])
    tree = layout.tree(torch.tensor(7), torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]]))
    assert tree.tokens_N.tolist() == [7, 10, 12, 21, 23]                       # by rank
    tree = layout.tree(torch.tensor(7), torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]]), by_child_order=True)
    assert tree.tokens_N.tolist() == [7, 10, 11, 20, 21]                       # child j takes draw j
    with pytest.raises(ValueError, match="lacks its parent"):
        StaticLayout([[1, 0]])


# ---------------------------------------------------------------- drafting and verification


@pytest.fixture(scope="module")
def tiny_target():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    return model, TargetRunner(model, 256, [])


def _head_for(model, seed=0, heads=4):
    head = _trained_like(MedusaHead(_config(heads=heads), init_from_target=True), seed=seed, scale=0.3)
    head.load_target_weights(None, model.get_output_embeddings().weight.detach())
    return head.eval()


@pytest.mark.parametrize("choices,top_k,nodes", [(None, 4, 12), ([[0], [0, 0], [0, 0, 0]], 1, 4),
                                                 ([[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0], [0, 0, 0, 2]], 3, 8)])
def test_greedy_speculative_equals_plain_greedy(tiny_target, choices, top_k, nodes):
    model, runner = tiny_target
    drafter = MedusaDrafter(_head_for(model, seed=nodes), 256, TreeConfig(4, top_k, nodes, choices))
    for seed in range(4):
        prompt = torch.randint(0, V, (3 + 5 * seed,), generator=torch.Generator().manual_seed(seed))
        base = plain_generate(runner, prompt, 32, GREEDY, set())
        assert speculative_generate(runner, drafter, prompt, 32, GREEDY, set()).tokens == base.tokens


def test_a_head_that_knows_the_target_is_accepted(tiny_target):
    """Heads whose lm_heads are the target's, on a target that repeats itself: drafts get accepted
    (the acceptance path is exercised, not only rejections)."""
    model, runner = tiny_target
    head = MedusaHead(_config(heads=3), init_from_target=True)
    head.load_target_weights(None, model.get_output_embeddings().weight.detach())
    drafter = MedusaDrafter(head.eval(), 256, TreeConfig(3, 2, 6))
    prompt = torch.tensor([5] * 20)
    out = speculative_generate(runner, drafter, prompt, 40, GREEDY, set())
    assert out.tokens == plain_generate(runner, prompt, 40, GREEDY, set()).tokens
    assert sum(out.accept_lengths) > 0


def _proposal_tree(q_V: torch.Tensor, tokens: list[int]) -> Tree:
    n = len(tokens) + 1
    parent = torch.tensor([-1] + [0] * (n - 1))
    depth = torch.tensor([0] + [1] * (n - 1))
    return Tree(torch.tensor([0] + tokens), parent, depth, ancestor_mask(parent, depth),
                proposal_RV=q_V[None], child_proposal_N=torch.tensor([0] + [-1] * (n - 1)))


def test_rejection_with_proposals_emits_the_target_distribution():
    """Children drawn from q without replacement, verified by recursive rejection against p: the first
    emitted token follows p exactly (chi-square over 6 tokens, 15k draws)."""
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    q = torch.softmax(torch.tensor([0.0, 2.0, 1.0, 0.5, 0.2, -2.0]), -1)
    cfg = SamplingConfig(temperature=1.0)
    p = processed_probs(p_logits, cfg)
    counts = torch.zeros(6)
    logits = p_logits.expand(4, 6)
    for _ in range(15000):
        keys = torch.log(q) - torch.log(-torch.log(torch.rand(6, generator=gen)))
        draws = torch.topk(keys, 3).indices.tolist()
        path, bonus = verify_sampling(_proposal_tree(q, draws), logits, cfg, gen)
        counts[int(draws[path[1] - 1]) if len(path) > 1 else int(bonus)] += 1
    expected = p * counts.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5   # 5 dof, p = 0.001


def test_sampled_speculative_follows_the_target_on_a_model(tiny_target):
    """Joint distribution of the first two generated tokens, speculative (sampled drafts, proposals)
    against the target's exact joint: total variation within sampling noise."""
    model, runner = tiny_target
    drafter = MedusaDrafter(_head_for(model, seed=5, heads=3), 256, TreeConfig(3, 3, 8))
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    prompt = torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(11))
    tv, support_ok = two_token_total_variation(model, runner, drafter, prompt, cfg, num_samples=1500, seed=1)
    assert support_ok and tv < 0.08  # E[TV] of 1500 draws over these ~16 outcomes is about 0.04


def test_typical_acceptance_follows_its_threshold():
    """p(x) > min(eps, alpha * exp(-H(p))) under the parent's distribution; the longest such path wins."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]))
    parent, depth = torch.tensor([-1, 0, 0]), torch.tensor([0, 1, 1])
    cfg = SamplingConfig(temperature=1.0, acceptance="typical", posterior_threshold=0.09, posterior_alpha=0.3)
    # root entropy 1.14 nats -> threshold min(0.09, 0.3 * 0.32) = 0.09: token 3 (0.05) fails, token 2 (0.15) passes
    tree = Tree(torch.tensor([0, 3, 2]), parent, depth, ancestor_mask(parent, depth))
    path, _ = verify_typical(tree, logits, cfg, torch.Generator().manual_seed(0))
    assert path.tolist() == [0, 2]
    tree = Tree(torch.tensor([0, 3, 3]), parent, depth, ancestor_mask(parent, depth))
    assert verify_typical(tree, logits, cfg, torch.Generator().manual_seed(0))[0].tolist() == [0]


# ---------------------------------------------------------------- exports read back by the engines' rules


def _vllm_rules_logits(directory: Path, f: torch.Tensor) -> torch.Tensor:
    """vLLM's Medusa loader, written from its rules: 'num'+'heads' -> num_heads, 'num'+'layers' ->
    num_hidden_layers; Linear bias only with medusa_fc_bias; 'medusa_heads.' stripped; original_lm_head
    takes lm_head.weight (or lm_heads.0.weight)."""
    raw = json.loads((directory / "config.json").read_text())
    cfg = {("num_heads" if "num" in k and "heads" in k else "num_hidden_layers" if "num" in k and "layers" in k else k): v
           for k, v in raw.items()}
    w = {k.replace("medusa_heads.", ""): v.float() for k, v in load_file(str(directory / "model.safetensors")).items()}
    bias = cfg.get("medusa_fc_bias", False)
    assert all(k.startswith(("blocks.", "lm_heads.", "lm_head.")) for k in w)
    out = []
    for h in range(cfg["num_heads"]):
        x = f
        for l in range(cfg["num_hidden_layers"]):
            x = x + F.silu(F.linear(x, w[f"blocks.{h}.layers.{l}.weight"], w[f"blocks.{h}.layers.{l}.bias"] if bias else None))
        lm = (w.get("lm_head.weight", w.get("lm_heads.0.weight")) if cfg.get("original_lm_head") else w[f"lm_heads.{h}.weight"])
        out.append(x @ lm.T)
    return torch.stack(out)


def _fasterdecoding_rules_logits(directory: Path, f: torch.Tensor) -> torch.Tensor:
    """FasterDecoding's MedusaModel: head h = Sequential(ResBlock x L, Linear(bias=False)), ResBlock =
    x + SiLU(linear(x)); weights {h}.{l}.linear.* and {h}.{L}.weight; TensorRT-LLM reads the .pt file."""
    cfg = json.loads((directory / "config.json").read_text())
    w = {k: v.float() for k, v in torch.load(directory / "medusa_lm_head.pt", weights_only=True).items()}
    same = load_file(str(directory / "medusa_lm_head.safetensors"))
    assert set(same) == set(w)
    L, out = cfg["medusa_num_layers"], []
    for h in range(cfg["medusa_num_heads"]):
        x = f
        for l in range(L):
            x = x + F.silu(F.linear(x, w[f"{h}.{l}.linear.weight"], w[f"{h}.{l}.linear.bias"]))
        out.append(x @ w[f"{h}.{L}.weight"].T)
    return torch.stack(out)


def _checkpoint(tmp_path, head, target_dir="tiny-target"):
    meta = {"kind": "medusa", "target_id": str(target_dir), "layer_ids": [], "draft_config": head.config, "step": 1}
    artifacts.save_checkpoint(tmp_path / "head", head.trainable_state(), meta)
    return tmp_path / "head"


@pytest.mark.parametrize("layers", [1, 2])
def test_exports_read_back_by_engine_rules_and_import_round_trip(tmp_path, layers):
    from draftsmith.runtime.export import export_head
    head = _trained_like(MedusaHead(_config(heads=3, layers=layers), init_from_target=True), seed=layers)
    head.load_target_weights(None, torch.randn(V, H))
    ckpt = _checkpoint(tmp_path, head)
    f = torch.randn(5, H)
    ours = head.head_logits(f[None])[:, 0].detach()
    target_config = LlamaConfig(vocab_size=V, hidden_size=H, num_attention_heads=4)
    for engine, reader in (("vllm", _vllm_rules_logits), ("fasterdecoding", _fasterdecoding_rules_logits)):
        out = tmp_path / engine
        export_head(str(ckpt), engine, str(out), dtype="fp32", allow_unvalidated=True)
        torch.testing.assert_close(reader(out, f), ours, rtol=1e-5, atol=1e-5)
        loaded, meta = load_head(out, target_config)
        assert meta["source_format"] == engine and loaded.config["medusa_num_layers"] == layers
        torch.testing.assert_close(loaded.head_logits(f[None])[:, 0], ours, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="Medusa-1 head"):
        export_head(str(ckpt), "merged-target", str(tmp_path / "merged"), allow_unvalidated=True)


def test_medusa2_exports_point_engines_at_the_fine_tuned_target(tmp_path):
    """Every place an engine reads the base model (FasterDecoding's base_model_name_or_path, the serve lines)
    names the merged fine-tuned target written beside the heads, never the original target."""
    from draftsmith.runtime.export import export_head
    head = _trained_like(MedusaHead(_config(heads=3, lora=LoraJointConfig(rank=4)), init_from_target=True))
    head.load_target_weights(None, torch.randn(V, H))
    ckpt = _checkpoint(tmp_path, head, "original-target")
    export = tmp_path / "export"
    for engine in ("fasterdecoding", "vllm"):
        out = export_head(str(ckpt), engine, str(export / engine), dtype="fp32", allow_unvalidated=True)
        card = (export / engine / "README.md").read_text()
        assert str(export / "merged-target") in out["serve"] and "original-target" not in out["serve"]
        assert "original-target" not in card.split("## Serve")[1]
    config = json.loads((export / "fasterdecoding" / "config.json").read_text())
    assert config["base_model_name_or_path"] == str(export / "merged-target")
    medusa1 = _checkpoint(tmp_path / "m1", _trained_like(MedusaHead(_config(heads=3), init_from_target=True)), "original-target")
    out = export_head(str(medusa1), "fasterdecoding", str(tmp_path / "m1" / "fd"), dtype="fp32", allow_unvalidated=True)
    assert "original-target" in out["serve"]                                   # Medusa-1 serves the original


def test_a_heads_only_stage_as_long_as_the_run_is_refused_naming_both_numbers():
    """heads_only_steps >= the run's optimizer steps: stage 2 (the adapters) would never start and the run
    would end as Medusa-1 calling itself Medusa-2."""
    from draftsmith.train.joint import heads_only_steps
    with pytest.raises(ValueError, match=r"heads_only_steps=400 but the run has 380 optimizer steps"):
        heads_only_steps(LoraJointConfig(heads_only_steps=400), 380)
    assert heads_only_steps(LoraJointConfig(heads_only_steps=100), 380) == 100
    assert heads_only_steps(LoraJointConfig(), 380) == 126


def test_import_published_layouts_with_understated_head_count(tmp_path):
    """FasterDecoding's medusa-vicuna-7b-v1.3 config says 2 heads while the file holds 5 (REFERENCE §3):
    the weights decide. A vLLM-layout head without biases imports as zero biases (the same function)."""
    K, gen = 5, torch.Generator().manual_seed(0)
    fd = tmp_path / "fd"
    fd.mkdir()
    weights = {}
    for h in range(K):
        weights[f"{h}.0.linear.weight"] = torch.randn(H, H, generator=gen) * 0.1
        weights[f"{h}.0.linear.bias"] = torch.randn(H, generator=gen) * 0.1
        weights[f"{h}.1.weight"] = torch.randn(V, H, generator=gen)
    torch.save(weights, fd / "medusa_lm_head.pt")
    published = PUBLISHED["medusa__FasterDecoding__medusa-vicuna-7b-v1.3"]["config"]
    (fd / "config.json").write_text(json.dumps({**published, "base_model_name_or_path": "tiny"}))
    head, meta = load_head(fd, LlamaConfig(vocab_size=V, hidden_size=H, num_attention_heads=4))
    assert head.num_heads == K and meta["source_format"] == "fasterdecoding"
    torch.testing.assert_close(head.lm_heads[4].weight, weights["4.1.weight"])
    vl = tmp_path / "vllm"
    vl.mkdir()
    save_file({f"medusa_heads.blocks.{h}.layers.0.weight": weights[f"{h}.0.linear.weight"] for h in range(K)}
              | {f"lm_heads.{h}.weight": weights[f"{h}.1.weight"] for h in range(K)}, str(vl / "model.safetensors"))
    (vl / "config.json").write_text(json.dumps(PUBLISHED["medusa__abhigoyal__vllm-medusa-vicuna-7b-v1.3"]["config"]
                                               | {"hidden_size": H, "vocab_size": V}))
    head, meta = load_head(vl, LlamaConfig(vocab_size=V, hidden_size=H, num_attention_heads=4))
    assert meta["source_format"] == "vllm" and not head.blocks[0].layers[0].bias.any()
    with pytest.raises(ValueError, match="hidden size"):
        load_head(fd, LlamaConfig(vocab_size=V, hidden_size=H * 2, num_attention_heads=4))


# ---------------------------------------------------------------- joint training pieces


def test_joint_param_groups_stage_switch_and_state(micro_target):
    """Adapters learn nothing in stage 1 (lr 0, no gradient), the heads at 4x lr; checkpoints hold only
    heads + adapters; the KL term starts at zero (B = 0: adapted target == target)."""
    from draftsmith.targets.lora import attach_lora
    from draftsmith.train.joint import JointModel, ramp
    from draftsmith.train.trainer import lr_lambda
    model = LlamaForCausalLM.from_pretrained(micro_target, dtype=torch.float32)
    cfg = LoraJointConfig(rank=4, heads_only_steps=3)
    head = MedusaHead(draft_config_from_target(model.config, HeadConfig(kind="medusa", lora=cfg)), init_from_target=True)
    head.load_target_weights(None, model.get_output_embeddings().weight.detach())
    joint = JointModel(attach_lora(model, cfg), head, cfg, total_steps=10)
    heads, adapters = joint.param_groups(1e-3)
    assert heads["lr"] == pytest.approx(4e-3) and adapters["start_step"] == 3 and adapters["params"]
    assert lr_lambda(10, 0.0, 3)(2) == 0.0 and lr_lambda(10, 0.0, 3)(3) > 0
    assert ramp("sine", 0.0) == 0.0 and ramp("sine", 1.0) == pytest.approx(1.0) and ramp("linear", 0.5) == 0.5
    state = joint.state_dict()
    assert state and all(k.startswith("head.") or "lora_" in k for k in state)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    batch = {"input_ids": ids, "position_ids": torch.arange(16).expand(2, 16), "loss_valid": torch.ones(2, 16, dtype=torch.bool)}
    loss1, m1 = joint.loss(batch | {"step": 0})
    loss1.backward()
    assert all(p.grad is None for p in adapters["params"]) and m1["stage"] == 1
    loss2, m2 = joint.loss(batch | {"step": 5})
    assert m2["stage"] == 2 and float(m2["kl"]) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="target_modules"):
        attach_lora(LlamaForCausalLM.from_pretrained(micro_target), LoraJointConfig(target_modules=["c_attn"]))


# ---------------------------------------------------------------- end to end on the micro target


MICRO = str(ROOT / "recipes/demo/micro-eagle3.yaml")
MEDUSA = ["head.kind=medusa", "validate.depth=3", "validate.top_k=3", "validate.num_nodes=6", "validate.num_calibration_prompts=2",
          "data.max_conversations=80"]
JOINT = ["capture.mode=online", "head.lora={rank: 4, alpha: 8, heads_only_steps: 4}", "train.max_steps=8",
         "train.save_every=3", "train.log_every=1"]


def _losses(recipe) -> dict[int, float]:
    from draftsmith.train.trainer import train_dir
    lines = (train_dir(recipe) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r and "eval" not in r}


@pytest.mark.slow
def test_medusa1_pipeline_trains_validates_and_exports(tmp_path, micro_target):
    from draftsmith.data.capture import run_capture
    from draftsmith.data.prepare import run_data
    from draftsmith.heads.registry import capture_needs
    from draftsmith.runtime.validate import run_validate
    from draftsmith.train.run import run_train
    recipe = micro_recipe(tmp_path, micro_target, *MEDUSA, "name=m1", "train.max_steps=8")
    run_data(recipe)
    run_capture(recipe, capture_needs("medusa"))
    manifest = run_train(recipe)
    assert {"top1_0", "top5_3", "sim_accept_len"} <= set(manifest["final_metrics"])
    result = run_validate(recipe)
    assert result["exact_match"]
    validation = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())
    choices = validation["tree"]["choices"]
    assert validation["calibration"]["choices"] == choices and 1 <= len(choices) <= 5


@pytest.mark.slow
def test_medusa2_joint_training_resumes_exactly_across_stages_and_reports_drift(tmp_path, micro_target):
    """Killed in stage 2 after a stage-1 checkpoint... resumed: the same loss curve as a straight run.
    Then validate reports drift, and the merged target loads with plain transformers and gives the
    logits of the peft model it was merged from."""
    from draftsmith.data.prepare import run_data
    from draftsmith.runtime.validate import run_validate
    from draftsmith.stages import stage_export
    from draftsmith.train.trainer import complete_checkpoints, head_dir, train_dir
    runs = {}
    for name in ("straight", "killed"):
        recipe = micro_recipe(tmp_path / name, micro_target, *MEDUSA, *JOINT, "name=m2")
        run_data(recipe)
        runs[name] = recipe
    cmd = lambda r: [sys.executable, "-m", "draftsmith.cli", "train", "--recipe", MICRO, f"out_dir={r.out_dir}",  # noqa: E731
                     f"target.model={r.target.model}", "target.embedded.max_steps=150", "target.embedded.train_seconds=600",
                     *MEDUSA, *JOINT, "name=m2"]
    subprocess.run(cmd(runs["straight"]), check=True, capture_output=True)
    killer = [sys.executable, str(FIXTURES / "train_until_killed.py"), "5"]
    proc = subprocess.run(killer + cmd(runs["killed"])[3:], capture_output=True)
    assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    assert [p.name for p in complete_checkpoints(train_dir(runs["killed"]) / "checkpoints")] == ["step-00000003"]
    stage1, _ = artifacts.load_checkpoint(train_dir(runs["killed"]) / "checkpoints" / "step-00000003" / "head")
    assert all(not v.any() for k, v in stage1.items() if "lora_B" in k)     # adapters untouched in stage 1
    resumed = subprocess.run(cmd(runs["killed"]), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    a, b = _losses(runs["straight"]), _losses(runs["killed"])
    assert sorted(a) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    recipe = runs["killed"]
    adapter = load_file(str(head_dir(recipe) / "lora" / "adapter_model.safetensors"))
    assert any(v.any() for k, v in adapter.items() if "lora_B" in k)            # stage 2 trained them
    result = run_validate(recipe)
    assert result["exact_match"]                                                 # exact against the fine-tuned target
    validation = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())
    drift = validation["drift"]
    assert 0 <= drift["greedy_token_agreement"] <= 1 and drift["mean_kl_per_token"] >= 0
    assert drift["perplexity_original"] > 1 and drift["perplexity_finetuned"] > 1
    assert 0 <= drift["teacher_forced_top1_agreement"] <= 1                  # not positional on free-running outputs
    assert len(drift["first_divergence_per_prompt"]) == drift["num_prompts"]
    import argparse
    written = stage_export(recipe, argparse.Namespace(allow_unvalidated=False))
    assert set(written) == {"vllm", "fasterdecoding", "merged-target", "lora"}
    from peft import PeftModel
    from draftsmith.targets.lora import merge_adapter
    merged = LlamaForCausalLM.from_pretrained(written["merged-target"]["out"])
    assert merged.dtype == torch.float32 and validation["dtype"] == "torch.float32"   # the dtype validated, not bf16
    validated = merge_adapter(LlamaForCausalLM.from_pretrained(micro_target, dtype=torch.float32), head_dir(recipe) / "lora")
    assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), validated.state_dict().values()))
    peft = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(micro_target, dtype=torch.float32),
                                     written["lora"]["out"]).eval()
    ids = torch.randint(0, merged.config.vocab_size, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, peft(ids).logits, rtol=1e-4, atol=1e-4)
    card = (Path(written["vllm"]["out"]) / "README.md").read_text()
    assert "changes the served model" in card and "saved in torch.float32" in card
    assert json.loads((Path(written["fasterdecoding"]["out"]) / "config.json").read_text())[
        "base_model_name_or_path"] == written["merged-target"]["out"]
    # validation prompts without answers: perplexity is not measured, and says so (never a made-up 1.0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(3)))
    recipe.validate.prompts, recipe.validate.num_prompts = str(prompts), 3
    run_validate(recipe)
    drift = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())["drift"]
    assert drift["perplexity_original"] is None and drift["num_perplexity_conversations"] == 0
    assert "perplexity: not measured" in (recipe.run_dir / "validate" / "report.md").read_text()
