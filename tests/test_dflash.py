"""DFlash: the training mask against its definition, training against drafting (the same logits for the same
anchor), overfitting a batch, greedy exactness and sampled losslessness in the runtime, the z-lab and speculators
exports as the engines' loaders read them, import of a z-lab checkpoint, transformers' own DFlash decoding drafting
what our drafter drafts, and the whole pipeline."""
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from conftest import feature_batch, micro_recipe, tiny_llama, two_token_total_variation
from draftsmith.heads.dflash import loss as dloss
from draftsmith.heads.dflash.draft import DFlashDrafter
from draftsmith.heads.dflash.formats import import_layout, to_speculators, to_transformers, to_vllm
from draftsmith.heads.dflash.model import DFlashHead, default_layer_ids
from draftsmith.heads.drafting import TreeConfig
from draftsmith.heads.loading import load_head
from draftsmith.recipe import HeadConfig
from draftsmith.runtime.generate import plain_generate, speculative_generate
from draftsmith.runtime.target import TargetRunner
from draftsmith.runtime.validate import generate_reference
from draftsmith.runtime.verify import SamplingConfig

V, H, IDS = 64, 32, [1, 3, 5]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(V, H)


def _head(target, block=4, layers=2, anchors=6, seed=0):
    torch.manual_seed(seed)
    head = DFlashHead.from_target(target.config, HeadConfig(kind="dflash", block_size=block, num_layers=layers,
                                                            num_anchors=anchors), IDS)
    head.load_target_weights(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return head


def _batch(target, B=2, T=14, seed=0):
    return feature_batch(target, IDS, B, T, seed)


def test_default_layer_ids_follow_zlab():
    assert default_layer_ids(36) == [k + 1 for k in (1, 9, 17, 25, 33)]  # Qwen3-8B
    assert default_layer_ids(36, 1) == [19]


def test_block_mask_is_its_definition():
    anchors, ok = torch.tensor([[2, 5, 7], [3, 1, 1]]), torch.tensor([[True, True, True], [True, False, False]])
    T, Bs = 9, 3
    mask = dloss.block_mask(anchors, ok, T, Bs)
    for b in range(2):
        for q in range(3 * Bs):
            a = q // Bs
            for k in range(T + 3 * Bs):
                if k < T:
                    expected = bool(ok[b, a]) and k < int(anchors[b, a])    # context strictly before the anchor
                else:
                    expected = (k - T) // Bs == a                           # its own block, both ways
                assert bool(mask[b, q, k]) == expected, (b, q, k)


def test_grouped_anchors_equal_one_group(target, monkeypatch):
    head, batch = _head(target), _batch(target)
    torch.manual_seed(3)
    whole, metrics = head(batch)
    grads = torch.autograd.grad(whole, [p for p in head.parameters() if p.requires_grad])
    monkeypatch.setattr(dloss, "SCORE_BUDGET", 1)  # one anchor per group, each checkpointed
    torch.manual_seed(3)
    grouped, metrics_g = head(batch)
    grads_g = torch.autograd.grad(grouped, [p for p in head.parameters() if p.requires_grad])
    torch.testing.assert_close(whole, grouped)
    for a, b in zip(grads, grads_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert metrics["num_anchors"] == 12 and set(metrics) >= {"acc_0", "acc_2", "sim_accept_len", "loss"}


def _trained_block(head, batch, p: int, masks=None):
    """The logits training gives the block anchored at p (slots 1..3 of a block of 4), under `masks` (default: the
    head's own, `masks_for`), and the drafter's for the same root with p committed positions."""
    with torch.no_grad():
        kv = head.context_kv(head.context(batch["aux"]), batch["position_ids"])
        anchors, ok = torch.tensor([[p]]), torch.tensor([[True]])
        tokens = torch.full((1, 4), head.mask_token_id)
        tokens[0, 0] = batch["input_ids"][0, p]
        masks = dloss.masks_for(head, anchors, ok, batch["input_ids"].shape[1]) if masks is None else masks(anchors, ok)
        trained = head.logits(head.block_hidden(tokens, p + torch.arange(4)[None], kv, masks)[:, 1:]).float()
    drafter = DFlashDrafter(head, 64, TreeConfig(3, 1, 4))
    drafter.extend(batch["input_ids"][0, 1:p + 1], batch["aux"][0, :p])
    return trained, drafter.block_logits(batch["input_ids"][0, p:p + 1], drafter.depth)


def test_training_and_drafting_compute_the_same_block(target):
    """The logits training gives anchor p's block equal the drafter's for the same root with p committed positions."""
    trained, drafted = _trained_block(_head(target).eval(), _batch(target, B=1), 9)
    torch.testing.assert_close(drafted, trained, rtol=1e-5, atol=1e-5)


def test_drafting_fewer_slots_runs_the_shorter_block(target):
    """A drafter of depth 3 on a head of blocks of 8 runs the block [root, MASK x 3] (what an engine serving it with
    num_speculative_tokens = 3 runs): the training forward of a block of 4 gives its logits, not the full block's."""
    head, batch, p = _head(target, block=8).eval(), _batch(target, B=1), 9
    short, drafted = _trained_block(head, batch, p, lambda a, ok: dloss.block_mask(a, ok, batch["input_ids"].shape[1], 4))
    torch.testing.assert_close(drafted, short, rtol=1e-5, atol=1e-5)
    drafter = DFlashDrafter(head, 64, TreeConfig(7, 1, 8))
    drafter.extend(batch["input_ids"][0, 1:p + 1], batch["aux"][0, :p])
    full = drafter.block_logits(batch["input_ids"][0, p:p + 1], drafter.depth)
    assert full.shape[1] == 7 and not torch.allclose(full[:, :3], drafted, atol=1e-4)  # the 4 extra masks are seen


def test_a_round_is_one_draft_forward(target):
    """Committing keeps the target's features and computes nothing; the next block's forward projects the new
    context rows with its own (fc once, each layer once) and leaves in the cache the context K/V that the
    context's own projection gives, for one row and for rows of different lengths."""
    head, batch, p = _head(target).eval(), _batch(target, B=2), 9
    calls = []
    head.fc.register_forward_hook(lambda *_: calls.append("fc"))
    for layer in head.layers:
        layer.register_forward_hook(lambda *_: calls.append("layer"))
    kv = head.context_kv(head.context(batch["aux"]), batch["position_ids"])
    for lengths in ([p], [p, p - 4]):
        calls.clear()
        drafter = DFlashDrafter(head, 64, TreeConfig(3, 1, 4), batch_size=len(lengths))
        drafter.extend_rows(list(range(len(lengths))), [batch["input_ids"][b, 1:n + 1] for b, n in enumerate(lengths)],
                            [batch["aux"][b, :n] for b, n in enumerate(lengths)])
        assert calls == [] and drafter.lengths == [0] * len(lengths)
        drafter.block_logits(batch["input_ids"][:len(lengths), 0], drafter.depth)
        assert calls == ["fc"] + ["layer"] * len(head.layers) and drafter.lengths == lengths
        for i, (k, v) in enumerate(kv):
            for b, n in enumerate(lengths):
                torch.testing.assert_close(drafter.k[i, b, :, :n], k[b, :, :n], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(drafter.v[i, b, :, :n], v[b, :, :n], rtol=1e-5, atol=1e-6)


def _overfit(head, batch, steps: int = 120) -> dict:
    """The metrics of the last of `steps` AdamW steps on one batch."""
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss, metrics = head(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return metrics


def test_head_overfits_a_batch(target):
    head, batch = _head(target, anchors=12), _batch(target, T=10)
    batch["target_probs"] = torch.nn.functional.one_hot(batch["input_ids"].roll(-1, 1), V).float()
    batch["target_argmax"] = batch["input_ids"].roll(-1, 1)
    metrics = _overfit(head, batch)
    assert metrics["acc_0"] > 0.9 and metrics["acc_1"] > 0.8


@pytest.mark.parametrize("tree", [TreeConfig(4, 1, 5), TreeConfig(4, 3, 10)], ids=["chain", "ddtree"])
def test_greedy_exact_and_sampling_follows_the_target(target, tree):
    head = _head(target, block=5).eval()
    runner = TargetRunner(target, 160, IDS)
    drafter = DFlashDrafter(head, 160, tree)
    for seed in range(3):
        prompt = torch.randint(0, V, (5 + 4 * seed,), generator=torch.Generator().manual_seed(seed))
        base = plain_generate(runner, prompt, 32, SamplingConfig(), set())
        spec = speculative_generate(runner, drafter, prompt, 32, SamplingConfig(), set())
        assert spec.tokens == base.tokens
        assert spec.tokens == generate_reference(target, prompt, 32, set())[0]
    if tree.top_k > 1:  # a DDTree: branches where the marginals leave doubt, within the node budget
        drafted = drafter.draft_trees(prompt[-1:])[0]
        assert len(drafted) == tree.num_nodes and max(len(drafted.children(n)) for n in range(len(drafted))) > 1
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    tv, support_ok = two_token_total_variation(target, runner, drafter, torch.randint(0, V, (6,)), cfg, 1500, seed=0)
    assert support_ok and tv < 0.07


ZLAB_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
              "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
              "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def _zlab_shapes(config: dict) -> dict:
    """Parameter names and shapes as vLLM's DFlashQwen3ForCausalLM builds them from a z-lab config."""
    Hd, d, n, kv = config["hidden_size"], config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    ffn, k = config["intermediate_size"], len(config["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": (Hd, k * config["target_hidden_size"]), "hidden_norm.weight": (Hd,), "norm.weight": (Hd,)}
    per_layer = dict(zip(ZLAB_LAYER, [(Hd,), (Hd,), (n * d, Hd), (kv * d, Hd), (kv * d, Hd), (Hd, n * d), (d,), (d,),
                                      (ffn, Hd), (ffn, Hd), (Hd, ffn)]))
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def test_exports_are_what_the_engines_load_and_a_zlab_checkpoint_imports(target, tmp_path):
    head = _head(target, block=4)
    config, tensors = to_vllm(head.trainable_state(), head.config, "fp32")
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 4 and config["num_target_layers"] == 6
    assert config["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [k - 1 for k in IDS]}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == _zlab_shapes(config)
    spec_config, spec_tensors = to_speculators(head.trainable_state(), head.config, "fp32")
    assert spec_config["speculators_model_type"] == "dflash" and spec_config["aux_hidden_state_layer_ids"] == IDS
    assert spec_config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert {"d2t", "t2d"} <= set(spec_tensors)
    # a z-lab checkpoint (names with a model. prefix, as some are saved) loads and drafts as the original head
    zlab = tmp_path / "zlab"
    zlab.mkdir()
    (zlab / "config.json").write_text(json.dumps(config))
    save_file({f"model.{k}": v.contiguous() for k, v in tensors.items()}, str(zlab / "model.safetensors"))
    loaded, meta = load_head(zlab, target.config, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    assert meta["source_format"] == "z-lab" and loaded.config["draftsmith"]["layer_ids"] == IDS
    prompt = torch.randint(0, V, (10,), generator=torch.Generator().manual_seed(4))
    runner = TargetRunner(target, 64, IDS)
    outs = []
    for h in (head.eval(), loaded):
        drafter = DFlashDrafter(h, 64, TreeConfig(3, 1, 4))
        outs.append(speculative_generate(runner, drafter, prompt, 16, SamplingConfig(), set()).accept_lengths)
    assert outs[0] == outs[1]
    config_back, _, _ = import_layout(zlab, config, target.config)
    assert config_back["block_size"] == 4 and config_back["dflash_config"]["mask_token_id"] == 0


@pytest.mark.slow
def test_dflash_pipeline_trains_validates_and_exports(tmp_path, micro_target):
    from draftsmith.stages import run_all
    recipe = micro_recipe(tmp_path, micro_target, "head.kind=dflash", "head.block_size=4", "head.num_layers=1",
                          "head.num_anchors=16", "head.draft_vocab_size=null", "train.max_steps=4", "validate.num_prompts=2", "validate.max_new_tokens=12",
                          "validate.top_k=1", "validate.num_nodes=4")
    summary = run_all(recipe)
    assert "greedy exact: True" in summary
    for engine in ("vllm", "sglang", "speculators", "transformers"):
        config = json.loads((recipe.run_dir / "export" / engine / "config.json").read_text())
        assert config.get("block_size") == 4
    card = (recipe.run_dir / "export" / "vllm" / "README.md").read_text()
    assert '"method": "dflash"' in card
    assert "speculation_type='dflash'" in (recipe.run_dir / "export" / "transformers" / "README.md").read_text()


def test_dflash_pipeline_with_a_draft_vocabulary(tmp_path, micro_target):
    """The pipeline with head.draft_vocab_size: the trainer's frequency vocabulary and teacher over it, a checkpoint
    carrying the lm_head rows and maps, exact validation, the vLLM and speculators exports, SGLang's skipped."""
    from safetensors.torch import load_file
    from draftsmith.stages import run_all
    recipe = micro_recipe(tmp_path, micro_target, "head.kind=dflash", "head.block_size=4", "head.num_layers=1",
                          "head.num_anchors=16", "head.draft_vocab_size=128", "train.max_steps=4", "validate.num_prompts=2",
                          "validate.max_new_tokens=12", "validate.top_k=1", "validate.num_nodes=4")
    summary = run_all(recipe)
    assert "greedy exact: True" in summary and "exported    vllm, speculators" in summary
    assert "sglang: SGLang's DFLASH drafts through the target's lm_head" in summary
    vllm = recipe.run_dir / "export" / "vllm"
    assert json.loads((vllm / "config.json").read_text())["draft_vocab_size"] == 128
    weights = load_file(str(vllm / "model.safetensors"))
    assert tuple(weights["lm_head.weight"].shape)[0] == 128 and tuple(weights["d2t"].shape) == (128,)
    assert json.loads((recipe.run_dir / "export" / "speculators" / "config.json").read_text())["draft_vocab_size"] == 128
    assert not (recipe.run_dir / "export" / "sglang" / "config.json").exists()


def test_commits_waiting_for_a_block_join_in_order(target):
    """Several commits before a block (rows committing none in some) give the block the context that one commit
    of the same positions gives: the same lengths, the same cache, the same drafts."""
    head, batch = _head(target).eval(), _batch(target, B=2)
    ids, aux, roots = batch["input_ids"], batch["aux"], batch["input_ids"][:, 0]
    splits = [[4, 2, 3], [5, 0, 0]]  # row 0 commits three times, row 1 once
    whole = DFlashDrafter(head, 64, TreeConfig(3, 1, 4), batch_size=2)
    whole.extend_rows([0, 1], [ids[b, 1:sum(n) + 1] for b, n in enumerate(splits)], [aux[b, :sum(n)] for b, n in enumerate(splits)])
    parts = DFlashDrafter(head, 64, TreeConfig(3, 1, 4), batch_size=2)
    for step in range(3):
        rows = [b for b in range(2) if splits[b][step]]
        start = [sum(splits[b][:step]) for b in rows]
        ends = [s + splits[b][step] for s, b in zip(start, rows)]
        parts.extend_rows(rows, [ids[b, s + 1:e + 1] for b, s, e in zip(rows, start, ends)],
                          [aux[b, s:e] for b, s, e in zip(rows, start, ends)])
    assert len(parts.pending) == 3
    torch.testing.assert_close(parts.block_logits(roots, 3), whole.block_logits(roots, 3), rtol=1e-5, atol=1e-5)
    assert parts.lengths == whole.lengths == [9, 5]
    for b, n in enumerate(whole.lengths):
        torch.testing.assert_close(parts.k[:, b, :, :n], whole.k[:, b, :, :n], rtol=1e-5, atol=1e-6)


def test_batched_block_drafting_is_exact_per_row(target):
    """Rows of different lengths drafted in one forward (economics' batched decoding) equal plain decoding per row."""
    from draftsmith.runtime.batched import BatchRunner, batch_max_len, batched_generate
    head = _head(target, block=4).eval()
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11, 8)]
    max_len = batch_max_len(prompts, 20, 4)
    drafter = DFlashDrafter(head, max_len, TreeConfig(3, 1, 4), batch_size=3)
    out = batched_generate(BatchRunner(target, 3, max_len, IDS), prompts, 20, SamplingConfig(), set(), drafter=drafter)
    runner = TargetRunner(target, max_len, IDS)
    assert out.tokens == [plain_generate(runner, p, 20, SamplingConfig(), set()).tokens for p in prompts]
    assert all(len(row) > 0 for row in out.accept_lengths)


def test_dpace_weights_follow_their_definition(target):
    ce = torch.tensor([[[0.1, 2.0, 0.5]]])
    a = 0.2
    q = (1 - a) * torch.exp(-ce[0, 0]) + a
    C = [q[0], q[0] * q[1], q[0] * q[1] * q[2]]
    expected = torch.stack([C[0] + C[1] + C[2], C[1] + C[2], C[2]])
    torch.testing.assert_close(dloss.dpace_weights(ce, a)[0, 0], expected)
    head, batch = _head(target), _batch(target)
    params = [p for p in head.parameters() if p.requires_grad]
    torch.manual_seed(5)
    decayed = torch.autograd.grad(head(batch)[0], params)
    head.dpace_alpha = 0.2
    torch.manual_seed(5)
    dpace = torch.autograd.grad(head(batch)[0], params)
    assert all(torch.isfinite(g).all() for g in dpace)
    assert not all(torch.allclose(a, b) for a, b in zip(decayed, dpace))  # other slot weights, another gradient


def test_qwen3_8b_recipe_has_the_published_settings_and_fits_its_launch():
    from pathlib import Path
    from conftest import target_config
    from draftsmith import plan, recipe as recipe_mod
    recipe = recipe_mod.load(Path(__file__).resolve().parent.parent / "recipes/qwen3-8b/dflash.yaml")
    assert (recipe.head.block_size, recipe.head.num_layers, recipe.head.num_anchors, recipe.head.loss_gamma) == (16, 5, 512, 7)
    assert recipe.capture.layer_ids == default_layer_ids(36) and recipe.head.mask_token_id == 151669
    out = plan.make_plan(recipe, target_config("Qwen/Qwen3-8B"), 8, 80)
    assert all(row["fits"] for row in out["stages"].values())
    head = DFlashHead.from_target(target_config("Qwen/Qwen3-8B"), recipe.head, recipe.capture.layer_ids)
    assert head.config["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}


def test_a_target_without_a_mask_candidate_is_refused_naming_the_key():
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, eos_token_id=None, pad_token_id=None)
    with pytest.raises(ValueError, match="head.mask_token_id: the target names no pad or eos token"):
        DFlashHead.from_target(config, HeadConfig(kind="dflash", block_size=4, num_layers=1), IDS)
    head = DFlashHead.from_target(config, HeadConfig(kind="dflash", block_size=4, num_layers=1, mask_token_id=7), IDS)
    assert head.config["dflash_config"]["mask_token_id"] == 7
    assert head.config["draftsmith"]["mask_token_source"] == "head.mask_token_id"


def _sliding_head(target, window=3):
    torch.manual_seed(0)
    head = DFlashHead.from_target(target.config, HeadConfig(kind="dflash", block_size=4, num_layers=2, num_anchors=6,
                                                            sliding_window=window), IDS)
    head.load_target_weights(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return head


def test_sliding_layers_mask_is_its_definition():
    """Sliding layers (z-lab's Qwen3.6 draft): context within the window of the query's position, the block causal."""
    anchors, ok = torch.tensor([[2, 7]]), torch.tensor([[True, True]])
    T, Bs, W = 9, 3, 4
    mask = dloss.sliding_block_mask(anchors, ok, T, Bs, W)
    for q in range(2 * Bs):
        a, slot = q // Bs, q % Bs
        p = int(anchors[0, a])
        for k in range(T + 2 * Bs):
            if k < T:
                expected = k < p and (p + slot) - k < W
            else:
                expected = (k - T) // Bs == a and (k - T) % Bs <= slot
            assert bool(mask[0, q, k]) == expected, (q, k)


def test_sliding_layers_train_as_they_draft_exactly_and_export(target, tmp_path):
    head = _sliding_head(target).eval()
    assert head.layer_types() == ["sliding_attention", "full_attention"]
    batch = _batch(target, B=1)
    trained, drafted = _trained_block(head, batch, 9)
    full, _ = _trained_block(head, batch, 9, lambda anchors, ok: dloss.block_mask(anchors, ok, 14, 4))
    assert not torch.allclose(trained, full)  # the window changes what the sliding layer sees
    torch.testing.assert_close(drafted, trained, rtol=1e-5, atol=1e-5)
    runner = TargetRunner(target, 96, IDS)
    prompt = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(3))
    spec = speculative_generate(runner, DFlashDrafter(head, 96, TreeConfig(3, 1, 4)), prompt, 24, SamplingConfig(), set())
    assert spec.tokens == generate_reference(target, prompt, 24, set())[0]
    config, tensors = to_vllm(head.trainable_state(), head.config, "fp32")
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 3
    assert config["use_sliding_window"] is True and config["dflash_config"]["swa_window_size"] == 3
    out = tmp_path / "swa"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    loaded, _ = load_head(out, target.config, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    assert loaded.layer_types() == head.layer_types() and loaded.config["sliding_window"] == 3
    with pytest.raises(ValueError, match="both ways inside the block"):  # transformers' assistant slides bidirectionally
        to_transformers(head.trainable_state(), head.config, "fp32")
    with pytest.raises(ValueError, match="head.layer_types"):
        DFlashHead.from_target(target.config, HeadConfig(kind="dflash", block_size=4, num_layers=2,
                                                         layer_types=["sliding_attention"]), IDS)


def test_ddtree_keeps_the_chain_and_the_most_probable_paths_under_the_marginals():
    """The DDTree over per-depth marginals holds the chain of argmaxes to the full depth (so its greedy acceptance is
    never below the chain's) and, besides, the paths of highest probability (the product of their tokens'
    marginals) among every path over each depth's top-k, found here by enumeration."""
    import itertools
    import math
    from draftsmith.heads.tree import ancestor_mask, marginal_trees
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 2
    probs = torch.softmax(logits, -1)
    tree = marginal_trees(torch.tensor([7]), logits[None], top_k=3, num_nodes=12)[0]
    top = probs.topk(3, dim=-1)
    paths = [p for d in range(1, 5) for p in itertools.product(range(3), repeat=d)]
    score = {p: math.prod(float(top.values[i, r]) for i, r in enumerate(p)) for p in paths}
    spine = [(0,) * d for d in range(1, 5)]
    best = spine + sorted((p for p in paths if p not in spine), key=lambda p: -score[p])[:11 - len(spine)]
    kept = set()
    for node in range(1, len(tree)):  # each node's path of tokens from the root
        path, n = [], node
        while n > 0:
            path.append(int(tree.tokens_N[n]))
            n = int(tree.parent_N[n])
        kept.add(tuple(reversed(path)))
    assert kept == {tuple(int(top.indices[i, r]) for i, r in enumerate(p)) for p in best}
    assert int(tree.tokens_N[0]) == 7 and torch.equal(tree.mask_NN, ancestor_mask(tree.parent_N, tree.depth_N))
    chain = marginal_trees(torch.tensor([7]), logits[None], top_k=1, num_nodes=4)[0]
    assert chain.tokens_N.tolist() == [7] + logits[:3].argmax(-1).tolist()


def _fit_to_target_continuation(head, target, prompt, steps=100):
    """The head trained on the target's own greedy continuation of `prompt`, so that it drafts partly right there."""
    seq = torch.cat([prompt, torch.tensor(generate_reference(target, prompt, 40, set())[0])])[None]
    with torch.no_grad():
        out = target(seq, output_hidden_states=True)
    probs = torch.softmax(out.logits.float(), -1)
    T = seq.shape[1]
    batch = {"input_ids": seq, "position_ids": torch.arange(T)[None], "aux": torch.cat([out.hidden_states[k] for k in IDS], -1),
             "target_probs": probs, "target_valid": torch.ones(1, T, dtype=torch.bool), "target_argmax": probs.argmax(-1)}
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss, _ = head(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def test_transformers_dflash_generation_drafts_what_our_drafter_drafts(target, tmp_path):
    """The `transformers` export loads with `AutoModel` as transformers' own DFlash assistant, and
    `generate(assistant_model=..., speculation_type="dflash")` drafts, round by round, the block logits our drafter
    drafts from the same context: the same number of rounds, partly accepted ones among them, the same output."""
    from safetensors.torch import save_file
    from transformers import AutoModel
    prompt = torch.randint(1, V, (9,), generator=torch.Generator().manual_seed(7))
    head = _fit_to_target_continuation(_head(target, block=5, anchors=16), target, prompt)
    config, tensors = to_transformers(head.trainable_state(), head.config, "fp32")
    out = tmp_path / "transformers"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    assistant = AutoModel.from_pretrained(out).eval()
    assert type(assistant).__name__ == "MuseGlimmerAssistantModel"
    theirs, ours = [], []
    assistant.register_forward_hook(lambda _m, _a, output: theirs.append(target.lm_head(output.last_hidden_state[:, 1:])[0]))
    runner = TargetRunner(target, 128, IDS)
    drafter = DFlashDrafter(head, 128, TreeConfig(4, 1, 5))
    block_logits = drafter.block_logits
    drafter.block_logits = lambda roots, slots=None: ours.append(block_logits(roots)[0]) or ours[-1][None, :slots]
    new = 56
    spec = speculative_generate(runner, drafter, prompt, new, SamplingConfig(), set())
    with torch.no_grad():
        hf = target.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=new,
                             assistant_model=assistant, speculation_type="dflash", do_sample=False, pad_token_id=0)
    assert hf[0, len(prompt):].tolist() == spec.tokens == generate_reference(target, prompt, new, set())[0]
    assert {0, 4} <= set(spec.accept_lengths) and any(0 < a < 4 for a in spec.accept_lengths)  # whole, in part, none
    assert len(theirs) >= len(ours) - 1 and len(ours) > 3
    for round_, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=f"round {round_}")
    # and the layout reads back into our head, drafting as the original
    loaded, meta = load_head(out, target.config, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    assert meta["source_format"] == "transformers" and loaded.config["draftsmith"]["layer_ids"] == IDS
    again = speculative_generate(runner, DFlashDrafter(loaded, 128, TreeConfig(4, 1, 5)), prompt, new, SamplingConfig(), set())
    assert again.accept_lengths == spec.accept_lengths


def _vocab_head(target, draft_vocab=40, block=4):
    """A DFlash head drafting over `draft_vocab` target tokens (speculators' option): the maps as the trainer sets them."""
    torch.manual_seed(0)
    head = DFlashHead.from_target(target.config, HeadConfig(kind="dflash", block_size=block, num_layers=2, num_anchors=8,
                                                            draft_vocab_size=draft_vocab), IDS)
    kept = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:draft_vocab].sort().values  # draft id -> target id
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    head.set_vocab(kept - torch.arange(draft_vocab), t2d)
    head.load_target_weights(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return head, kept


def test_a_draft_vocabulary_trains_drafts_exactly_and_exports_for_vllm_and_speculators(target, tmp_path):
    """head.draft_vocab_size below the target's: lm_head holds the target's rows of those tokens; the head overfits a
    batch whose tokens lie in it; drafts are target ids of the draft vocabulary and greedy decoding stays exact; vLLM's
    z-lab layout gets draft_vocab_size, lm_head [Vd, H] and d2t (target = draft + d2t), speculators' its maps, SGLang
    and transformers (no lm_head of their own) refuse it; the vLLM export imports back and drafts alike."""
    from draftsmith.heads.dflash.formats import to_sglang
    from draftsmith.heads.hf_layout import NotServable
    head, kept = _vocab_head(target)
    assert head.config["draft_vocab_size"] == 40 and tuple(head.lm_head.weight.shape) == (40, H)
    assert torch.equal(head.lm_head.weight, target.get_output_embeddings().weight[kept])
    assert {"lm_head.weight", "d2t", "t2d"} <= set(head.trainable_state())
    ids = kept[torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(2))]
    batch = _batch(target, T=10)
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    following = torch.searchsorted(kept, ids.roll(-1, 1))                                   # draft ids of the next tokens
    batch.update(input_ids=ids, aux=torch.cat([out.hidden_states[k] for k in IDS], -1), target_argmax=following,
                 target_probs=torch.nn.functional.one_hot(following, 40).float())
    metrics = _overfit(head, batch)
    assert metrics["acc_0"] > 0.9 and metrics["acc_1"] > 0.8
    assert torch.equal(head.lm_head.weight, target.get_output_embeddings().weight[kept])  # frozen
    head.eval()
    runner, prompt = TargetRunner(target, 96, IDS), torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(3))
    drafter = DFlashDrafter(head, 96, TreeConfig(3, 1, 4))
    spec = speculative_generate(runner, drafter, prompt, 24, SamplingConfig(), set())
    assert spec.tokens == plain_generate(runner, prompt, 24, SamplingConfig(), set()).tokens
    chain = drafter.draft_trees(prompt[-1:])[0]
    assert set(chain.tokens_N[1:].tolist()) <= set(kept.tolist())
    config, tensors = to_vllm(head.trainable_state(), head.config, "fp32")
    assert config["draft_vocab_size"] == 40
    shapes = _zlab_shapes(config) | {"lm_head.weight": (40, H), "d2t": (40,), "t2d": (V,)}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    assert torch.equal(torch.arange(40) + tensors["d2t"], kept)                             # vLLM's draft_id_to_target_id
    spec_config, spec_tensors = to_speculators(head.trainable_state(), head.config, "fp32")
    assert spec_config["draft_vocab_size"] == 40 and int(spec_tensors["t2d"].sum()) == 40
    assert tuple(spec_tensors["lm_head.weight"].shape) == (40, H)
    for refuses in (to_sglang, to_transformers):
        with pytest.raises(NotServable, match="draft vocabulary"):
            refuses(head.trainable_state(), head.config, "fp32")
    exported = tmp_path / "vllm"
    exported.mkdir()
    (exported / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items() if k != "t2d"}, str(exported / "model.safetensors"))
    loaded, _ = load_head(exported, target.config, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    assert torch.equal(loaded.t2d, head.t2d) and torch.equal(loaded.lm_head.weight, head.lm_head.weight)
    again = speculative_generate(runner, DFlashDrafter(loaded, 96, TreeConfig(3, 1, 4)), prompt, 24, SamplingConfig(), set())
    assert again.accept_lengths == spec.accept_lengths
    save_file({k: v.contiguous() for k, v in tensors.items() if k not in ("t2d", "d2t")}, str(exported / "model.safetensors"))
    with pytest.raises(ValueError, match=r"draft_vocab_size 40 .* lack \['d2t'\]"):
        load_head(exported, target.config)
    with pytest.raises(ValueError, match="head.draft_vocab_size=65"):
        DFlashHead.from_target(target.config, HeadConfig(kind="dflash", draft_vocab_size=65), IDS)
