"""P-EAGLE: COD sampling and the training attention against their definitions (a dense reference forward), training
against drafting (the same logits for the same anchor), overfitting a batch, greedy exactness and sampled
losslessness in the runtime, batched rows, the vLLM and speculators exports as the engines read them and their
import, the recipes, and the whole pipeline."""
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import feature_batch, micro_recipe, tiny_llama, two_token_total_variation
from draftsmith.heads.drafting import TreeConfig, attend_with_mask
from draftsmith.heads.eagle3 import formats as eagle3_formats
from draftsmith.heads.loading import load_head
from draftsmith.heads.peagle import formats, loss as ploss
from draftsmith.heads.peagle.draft import PEagleDrafter
from draftsmith.heads.peagle.model import PEagleHead
from draftsmith.heads.ttt import shift_left
from draftsmith.recipe import HeadConfig
from draftsmith.runtime.generate import plain_generate, speculative_generate
from draftsmith.runtime.target import TargetRunner
from draftsmith.runtime.validate import generate_reference
from draftsmith.runtime.verify import SamplingConfig

V, H, IDS = 64, 32, [1, 3, 5]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(V, H)


def _head(target, layers=2, depths=4, ratio=0.7, seed=0, draft_vocab=V):
    torch.manual_seed(seed)
    head = PEagleHead.from_target(target.config, HeadConfig(kind="peagle", draft_vocab_size=draft_vocab, num_layers=layers,
                                                            ttt_steps=depths, cod_ratio=ratio), IDS)
    head.load_target_weights(target.get_input_embeddings().weight)
    head.set_vocab(torch.zeros(draft_vocab, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    return head


def _batch(target, B=2, T=14, seed=0):
    batch = feature_batch(target, IDS, B, T, seed)
    if B > 1:
        batch["target_valid"][-1, T - 3:] = False  # the last row padded
    return batch


def test_cod_sampling_keeps_the_published_counts_of_nested_chains():
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[1, 30:] = False
    torch.manual_seed(0)
    chains = ploss.cod_chains(valid, 6, 0.7, 0.2)
    previous = [list(range(39))] * 2
    for d, (anchors, parent, ok) in enumerate(chains, start=1):
        for b in range(2):
            kept = anchors[b][ok[b]].tolist()
            candidates = [a for a in previous[b] if a + d + 1 <= 39 and valid[b, a + d + 1]]
            n_valid = int(valid[b, 1:].sum())
            assert len(kept) == min(int((n_valid - d) * max(0.7 ** d, 0.2)), len(candidates))
            assert all(previous[b][i] == a for i, a in zip(parent[b][ok[b]].tolist(), kept))   # nested chains
            assert all(a + d + 1 <= 39 and valid[b, a + d + 1] for a in kept)                   # targets exist
            previous[b] = kept
    assert len(chains) == 5


def _dense_reference(head, batch, chains):
    """The loss from the definition: every element (anchor, depth) as one row of a single forward under an explicit
    [rows x rows] visibility mask, per-depth mean losses averaged."""
    ids, pos, valid, probs = batch["input_ids"], batch["position_ids"], batch["target_valid"], batch["target_probs"]
    B, T = ids.shape
    tokens, hidden, positions, owner = [shift_left(ids, 1)], [head.project(batch["aux"])], [pos], []
    depth0 = [(t, 0) for t in range(T)]
    losses = []
    for b_rows in range(B):
        owner.append(list(depth0))
    for d, (anchors, _, ok) in enumerate(chains, start=1):
        n = anchors.shape[1]
        tokens.append(torch.full((B, n), head.mask_token_id))
        hidden.append(head.mask_state().expand(B, n, -1))
        positions.append(pos.gather(1, anchors) + d)
        for b in range(B):
            owner[b] += [(int(a), d) if bool(k) else (-1, d) for a, k in zip(anchors[b], ok[b])]
    N = len(owner[0])
    allowed = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        for q, (a, d) in enumerate(owner[b]):
            for k, (a2, d2) in enumerate(owner[b]):
                allowed[b, q, k] = (d2 == 0 and a2 <= a) if d2 == 0 else (a2 == a and 1 <= d2 <= d)
            allowed[b, q, q] = True
    h = head.run(torch.cat(tokens, 1), torch.cat(hidden, 1), torch.cat(positions, 1),
                 lambda i: (lambda q, k, v: attend_with_mask(q, k, v, allowed)))
    logq = torch.log_softmax(head.logits(h).float(), -1)
    ce0 = -(probs[:, 1:] * logq[:, :T - 1]).sum(-1)
    losses.append((ce0 * valid[:, 1:]).sum() / valid[:, 1:].sum())
    start = T
    for d, (anchors, _, ok) in enumerate(chains, start=1):
        n = anchors.shape[1]
        rows = (anchors + d + 1).clamp(max=T - 1)
        teacher = probs[torch.arange(B)[:, None], rows]
        ce = -(teacher * logq[:, start:start + n]).sum(-1)
        losses.append((ce * ok).sum() / ok.sum())
        start += n
    return sum(losses) / len(losses), logq


def test_cod_attention_and_loss_are_their_definition(target, monkeypatch):
    head, batch = _head(target), _batch(target)
    torch.manual_seed(1)
    chains = ploss.cod_chains(batch["target_valid"], head.depths, head.cod_ratio, head.cod_min_ratio)
    monkeypatch.setattr(ploss, "cod_chains", lambda *args: chains)
    params = [p for p in head.parameters() if p.requires_grad]
    loss, metrics = head(batch)
    grads = torch.autograd.grad(loss, params)
    reference, _ = _dense_reference(head, batch, chains)
    ref_grads = torch.autograd.grad(reference, params)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert set(metrics) >= {"acc_0", "acc_3", "loss_3", "sim_accept_len", "num_chain_slots"}
    monkeypatch.setattr(ploss, "SCORE_BUDGET", 1)  # one query per block, each checkpointed: the same numbers
    blocked = head(batch)[0]
    blocked_grads = torch.autograd.grad(blocked, params)
    torch.testing.assert_close(blocked, loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, blocked_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    head.checkpoint_steps = True  # train.activation_checkpointing: each depth recomputed in backward, same gradients
    again = head(batch)[0]
    for a, b in zip(grads, torch.autograd.grad(again, params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    trained = {id(p) for p in params}
    assert id(head.mask_hidden) in trained and id(head.embed_tokens.weight) in trained  # both trained, as P-EAGLE's


def test_training_and_drafting_compute_the_same_chain(target, monkeypatch):
    """The drafter's one forward for a row with a + 1 committed positions gives the logits training gives the
    elements (a, 0..K-1)."""
    head, batch = _head(target, ratio=1.0).eval(), _batch(target, B=1)
    a, K, T = 7, 4, 14
    chains = [(torch.tensor([[a]]), torch.tensor([[a if d == 1 else 0]]), torch.tensor([[True]])) for d in range(1, K)]
    with torch.no_grad():
        _, logq = _dense_reference(head, batch, chains)
    trained = logq[0, [a] + [T + d - 1 for d in range(1, K)]]
    drafter = PEagleDrafter(head, 64, TreeConfig(K, 1, K + 1))
    drafter.extend(batch["input_ids"][0, 1:a + 2], batch["aux"][0, :a + 1])
    torch.testing.assert_close(torch.log_softmax(drafter.chain_logits[0], -1), trained, rtol=1e-5, atol=1e-5)


def test_head_overfits_a_batch(target):
    head, batch = _head(target, ratio=1.0, depths=3), _batch(target, T=10)
    batch["target_probs"] = F.one_hot(batch["input_ids"].roll(-1, 1), V).float()
    batch["target_argmax"] = batch["input_ids"].roll(-1, 1)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(150):
        loss, metrics = head(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert metrics["acc_0"] > 0.9 and metrics["acc_1"] > 0.8 and metrics["acc_2"] > 0.7


@pytest.mark.parametrize("tree", [TreeConfig(4, 1, 5), TreeConfig(4, 3, 10)], ids=["chain", "ddtree"])
def test_greedy_exact_and_sampling_follows_the_target(target, tree):
    head = _head(target).eval()
    runner = TargetRunner(target, 160, IDS)
    drafter = PEagleDrafter(head, 160, tree)
    for seed in range(3):
        prompt = torch.randint(0, V, (5 + 4 * seed,), generator=torch.Generator().manual_seed(seed))
        base = plain_generate(runner, prompt, 32, SamplingConfig(), set())
        spec = speculative_generate(runner, drafter, prompt, 32, SamplingConfig(), set())
        assert spec.tokens == base.tokens == generate_reference(target, prompt, 32, set())[0]
    if tree.top_k > 1:  # a DDTree: branches where the marginals leave doubt, within the node budget
        drafted = drafter.draft_trees(prompt[-1:])[0]
        assert len(drafted) == tree.num_nodes and max(len(drafted.children(n)) for n in range(len(drafted))) > 1
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    tv, support_ok = two_token_total_variation(target, runner, drafter, torch.randint(0, V, (6,)), cfg, 1500, seed=0)
    assert support_ok and tv < 0.07


def test_batched_parallel_drafting_is_exact_per_row(target):
    from draftsmith.runtime.batched import BatchRunner, batch_max_len, batched_generate
    head = _head(target).eval()
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11, 8)]
    max_len = batch_max_len(prompts, 20, 4)
    drafter = PEagleDrafter(head, max_len, TreeConfig(3, 1, 4), batch_size=3)
    out = batched_generate(BatchRunner(target, 3, max_len, IDS), prompts, 20, SamplingConfig(), set(), drafter=drafter)
    runner = TargetRunner(target, max_len, IDS)
    assert out.tokens == [plain_generate(runner, p, 20, SamplingConfig(), set()).tokens for p in prompts]


def _vllm_eagle3_shapes(config: dict) -> dict:
    """Parameter names and shapes as vLLM's multi-layer EAGLE-3 Llama draft builds them from the config: layer 0
    reads 2H (embedding and hidden), later layers H; the embedding present in the checkpoint is the draft's own."""
    Hd, d, n, kv, ffn = (config[k] for k in ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads",
                                             "intermediate_size"))
    aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) * config["target_hidden_size"]
    shapes = {"embed_tokens.weight": (config["vocab_size"], Hd), "fc.weight": (Hd, aux), "mask_hidden": (1, 1, aux),
              "norm.weight": (Hd,), "lm_head.weight": (config["draft_vocab_size"], Hd),
              "d2t": (config["draft_vocab_size"],), "t2d": (config["vocab_size"],)}
    for i in range(config["num_hidden_layers"]):
        width = 2 * Hd if i == 0 else Hd
        layer = {"input_layernorm.weight": (Hd,), "post_attention_layernorm.weight": (Hd,),
                 "self_attn.q_proj.weight": (n * d, width), "self_attn.k_proj.weight": (kv * d, width),
                 "self_attn.v_proj.weight": (kv * d, width), "self_attn.o_proj.weight": (Hd, n * d),
                 "mlp.gate_proj.weight": (ffn, Hd), "mlp.up_proj.weight": (ffn, Hd), "mlp.down_proj.weight": (Hd, ffn)}
        if i == 0:
            layer["hidden_norm.weight"] = (Hd,)
        shapes.update({f"layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def test_exports_are_what_the_engines_load_and_import_back(target, tmp_path):
    from safetensors.torch import save_file
    head = _head(target, layers=3, draft_vocab=48)
    config, tensors = formats.to_vllm(head.trainable_state(), head.config, "fp32")
    assert config["parallel_drafting"] is True and config["mask_token_id"] == 0 and config["num_hidden_layers"] == 3
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == IDS
    assert {k: tuple(v.shape) for k, v in tensors.items()} == _vllm_eagle3_shapes(config)
    assert formats.recognizes(config) and not eagle3_formats.recognizes(config)
    spec_config, spec_tensors = formats.to_speculators(head.trainable_state(), head.config, "fp32")
    assert spec_config["speculators_model_type"] == "peagle" and spec_config["embed_requires_grad"] is True
    assert spec_config["transformer_layer_config"]["num_hidden_layers"] == 3 and "mask_hidden" in spec_tensors
    assert '"parallel_drafting": true' in formats.serve_command("vllm", "T", "D")
    for name, (cfg, tens) in {"vllm": (config, tensors), "speculators": (spec_config, spec_tensors)}.items():
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text(json.dumps(cfg))
        save_file({k: v.contiguous() for k, v in tens.items()}, str(out / "model.safetensors"))
        # the target's embedding is given, as validation gives it: the head's own trained one must win
        loaded, meta = load_head(out, target.config, torch.zeros_like(target.get_input_embeddings().weight))
        assert meta["kind"] == "peagle" and loaded.config["draftsmith"]["layer_ids"] == IDS
        for key, value in head.trainable_state().items():
            torch.testing.assert_close(loaded.state_dict()[key], value, msg=f"{name}: {key}")


@pytest.mark.slow
def test_peagle_pipeline_trains_validates_and_exports(tmp_path, micro_target):
    from draftsmith.stages import run_all
    recipe = micro_recipe(tmp_path, micro_target, "head.kind=peagle", "head.num_layers=2", "head.ttt_steps=4",
                          "train.max_steps=4", "validate.num_prompts=2", "validate.max_new_tokens=12",
                          "validate.top_k=1", "validate.depth=4", "validate.num_nodes=5")
    summary = run_all(recipe)
    assert "greedy exact: True" in summary
    config = json.loads((recipe.run_dir / "export" / "vllm" / "config.json").read_text())
    assert config["parallel_drafting"] is True and config["num_hidden_layers"] == 2
    assert '"parallel_drafting": true' in (recipe.run_dir / "export" / "vllm" / "README.md").read_text()
    assert json.loads((recipe.run_dir / "export" / "speculators" / "config.json").read_text())["speculators_model_type"] == "peagle"


def test_gpt_oss_120b_recipe_has_the_published_settings_and_fits_its_launch():
    from pathlib import Path
    from conftest import target_config
    from draftsmith import plan, recipe as recipe_mod
    recipe = recipe_mod.load(Path(__file__).resolve().parent.parent / "recipes/gpt-oss-120b/peagle.yaml")
    assert (recipe.head.kind, recipe.head.num_layers, recipe.head.draft_vocab_size) == ("peagle", 4, 32000)
    out = plan.make_plan(recipe, target_config("openai/gpt-oss-120b"), 8, 80)
    assert all(row["fits"] for row in out["stages"].values())


def test_cod_ratios_out_of_range_are_refused_naming_the_keys():
    from draftsmith import recipe as recipe_mod
    with pytest.raises(recipe_mod.RecipeError, match="head.cod_ratio=1.5"):
        recipe_mod.loads("name: x\ntarget: {model: m}\nhead: {kind: peagle, cod_ratio: 1.5}\n")
