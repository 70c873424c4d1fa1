"""The economics formulas against reference values (issue #14) and the schedule writer on a synthetic sweep."""
import pytest
import torch

from draftsmith.runtime import economics as E


def test_theorem_3_8_and_break_even_reference_values():
    assert E.expected_tokens(0.75, 4) == pytest.approx(3.0508, abs=1e-4)
    assert E.break_even_cost(E.expected_tokens(0.75, 4), 4) == pytest.approx(0.512695, abs=1e-6)
    assert E.expected_tokens(1.0, 4) == 5 and E.expected_tokens(0.0, 4) == 1
    assert E.alpha_from_tau(3.0508, 4) == pytest.approx(0.75, abs=1e-4)
    assert E.walltime_factor(3.0508, 4, 0.5127) == pytest.approx(1.0, abs=1e-3)   # at c* speculation breaks even


def test_cost_reference_values():
    assert E.usd_per_million_tokens(2.0, 45) == pytest.approx(12.35, abs=0.005)
    assert E.usd_per_million_tokens(2.0, 45 * 1.8) == pytest.approx(6.86, abs=0.005)
    assert E.break_even_extra_usd_per_hour(2.0, 1.8) == pytest.approx(1.60)
    with pytest.raises(ValueError, match="tokens_per_s"):
        E.usd_per_million_tokens(2.0, 0)


def test_schedule_from_a_synthetic_sweep():
    """Speculation wins at low batch, loses past the crossover: K falls with the batch size, then 0."""
    sweep = {1: {0: 40, 1: 60, 2: 75, 4: 90}, 2: {0: 80, 1: 115, 2: 140, 4: 150}, 4: {0: 150, 1: 200, 2: 230, 4: 210},
             8: {0: 300, 1: 360, 2: 340, 4: 290}, 16: {0: 560, 1: 540, 2: 500, 4: 420}, 32: {0: 900, 1: 800, 2: 700, 4: 600}}
    assert E.schedule(sweep) == [[1, 3, 4], [4, 7, 2], [8, 15, 1], [16, 32, 0]]
    assert E.schedule({1: {0: 10, 2: 10}}) == [[1, 1, 0]]          # a tie keeps the cheaper K
    with pytest.raises(ValueError, match="empty sweep"):
        E.schedule({})


def test_validate_prompts_file_domains_and_the_screen(tmp_path, micro_pipeline):
    """`validate.prompts`: conversations and plain prompts with domains; the screen reports tau and alpha per
    domain and per input-length bucket, Theorem 3.8's prediction and c*; bad files are named."""
    import json

    from conftest import micro_recipe

    from draftsmith.runtime.validate import run_validate
    lines = [{"prompt": "Write a function that reverses a list.", "domain": "code"},
             {"messages": [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "ignored"}], "domain": "code"},
             {"conversations": [{"from": "human", "value": "Explain what a dict is."}], "domain": "prose"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    recipe = micro_pipeline
    over = [f"validate.prompts={path}", "validate.num_prompts=3", "validate.max_new_tokens=12"]
    r = micro_recipe(recipe.out_dir, recipe.target.model, *over)
    assert run_validate(r, out=str(tmp_path / "v"))["exact_match"]
    screen = json.loads((tmp_path / "v" / "validation.json").read_text())["screen"]
    assert set(screen["per_domain"]) == {"code", "prose"} and screen["per_domain"]["code"]["num_prompts"] == 2
    assert sum(g["num_prompts"] for g in screen["per_input_length"].values()) == 3
    tau, gamma = screen["tau"], screen["gamma"]
    assert screen["break_even_c"] == pytest.approx((tau - 1) / gamma)
    assert screen["predicted_walltime_factor"] == pytest.approx(tau / (gamma * screen["c"] + 1))
    assert E.expected_tokens(screen["alpha_iid"], gamma) == pytest.approx(max(tau, 1.0), abs=1e-6)  # no rounds: tau 0, alpha 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        run_validate(micro_recipe(recipe.out_dir, recipe.target.model, f"validate.prompts={bad}"), out=str(tmp_path / "w"))
    with pytest.raises(ValueError, match="validate.prompts=.*no such file"):
        run_validate(micro_recipe(recipe.out_dir, recipe.target.model, f"validate.prompts={tmp_path / 'nope.jsonl'}"), out=str(tmp_path / "w"))


@pytest.fixture(scope="module")
def tiny_pair():
    """A random tiny Llama target and a smaller one with the same vocabulary (the draft model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    shape = dict(vocab_size=64, max_position_embeddings=512, eos_token_id=None)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
                                          num_key_value_heads=2, **shape)).eval()
    small = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, **shape)).eval()
    return target, small


def _batched_kinds(target, small):
    """name -> (layer ids the runner returns, factory batch_size -> drafter): every head kind (random
    heads, drafting in chains and dynamic trees) and both baselines, all batched drafters."""
    import torch

    from draftsmith.heads.drafting import TreeConfig
    from draftsmith.heads.eagle2.draft import Eagle2Drafter
    from draftsmith.heads.eagle2.model import Eagle2Head, draft_config_from_target as eagle2_config
    from draftsmith.heads.eagle3.draft import Eagle3Drafter
    from draftsmith.heads.eagle3.model import Eagle3Head, draft_config_from_target as eagle3_config
    from draftsmith.heads.medusa.draft import MedusaDrafter
    from draftsmith.heads.medusa.model import MedusaHead, draft_config_from_target as medusa_config
    from draftsmith.heads.mtp.draft import MTPDrafter
    from draftsmith.heads.mtp.model import MTPHead, draft_config_from_target as mtp_config
    from draftsmith.recipe import HeadConfig
    from draftsmith.runtime.baselines import DraftModelDrafter, NgramDrafter, chain_config
    embed, lm_head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    torch.manual_seed(3)
    eagle3 = Eagle3Head(eagle3_config(target.config, 64, [1, 2, 3])).eval()
    eagle3.set_vocab(torch.zeros(64, dtype=torch.long), torch.ones(64, dtype=torch.bool))
    eagle3.load_target_weights(embed)
    heads = {"eagle2": Eagle2Head(eagle2_config(target.config)), "mtp": MTPHead(mtp_config(target.config)),
             "medusa": MedusaHead(medusa_config(target.config, HeadConfig(kind="medusa", num_heads=3)))}
    with torch.no_grad():
        for head in heads.values():
            for param in head.parameters():
                param.normal_(0, 0.2) if param.requires_grad and param.dim() > 1 else None
            head.load_target_weights(embed, lm_head)
            head.eval()
    final = []                                 # the runner returns the final hidden state
    return {"eagle3 chain": ([1, 2, 3], lambda b: Eagle3Drafter(eagle3, 200, chain_config(3), batch_size=b)),
            "eagle3 tree": ([1, 2, 3], lambda b: Eagle3Drafter(eagle3, 200, TreeConfig(3, 2, 6), batch_size=b)),
            "eagle2 tree": (final, lambda b: Eagle2Drafter(heads["eagle2"], 200, TreeConfig(3, 3, 8), batch_size=b)),
            "mtp chain": (final, lambda b: MTPDrafter(heads["mtp"], 200, chain_config(3), batch_size=b)),
            "mtp tree": (final, lambda b: MTPDrafter(heads["mtp"], 200, TreeConfig(3, 2, 6), batch_size=b)),
            "medusa": (final, lambda b: MedusaDrafter(heads["medusa"], 200, TreeConfig(3, 2, 6), batch_size=b)),
            "ngram": ([1, 2, 3], lambda b: NgramDrafter(4, 3, 1, batch_size=b)),
            "draft-model": ([1, 2, 3], lambda b: DraftModelDrafter(small, 200, 3, batch_size=b))}


def test_batched_decoding_is_exact_per_row(tiny_pair):
    """B = 1, 3, 8 rows with mixed prompt lengths and per-row EOS, one batched drafter for the batch
    (every head kind in chains and dynamic trees, n-gram and draft-model drafts of differing sizes):
    every row equals plain greedy decoding of that prompt alone."""
    import torch

    from draftsmith.heads.tree import chain_tree
    from draftsmith.runtime.baselines import chain_config
    from draftsmith.runtime.batched import BatchRunner, batch_max_len, batched_generate
    from draftsmith.runtime.generate import plain_generate
    from draftsmith.runtime.target import TargetRunner
    from draftsmith.runtime.verify import SamplingConfig
    target, small = tiny_pair
    layers = [1, 2, 3]
    gen = torch.Generator().manual_seed(1)
    # repetitive prompts so that prompt lookup finds matches of differing lengths
    prompts = [torch.randint(0, 64, (n,), generator=gen).repeat(r)[: n * r] for n, r in
               [(3, 1), (7, 3), (20, 1), (4, 5), (11, 2), (2, 9), (30, 1), (6, 4)]]
    single = TargetRunner(target, 200, layers)
    greedy = SamplingConfig()
    probe = plain_generate(single, prompts[0], 24, greedy, set()).tokens
    eos = {probe[9]}                           # some rows stop early, at different rounds
    expected = [plain_generate(single, p, 24, greedy, eos).tokens for p in prompts]
    for size in (1, 3, 8):
        rows = prompts[:size]
        runners = {ids: BatchRunner(target, size, 200, list(ids)) for ids in ((1, 2, 3), ())}
        plain = batched_generate(runners[(1, 2, 3)], rows, 24, greedy, eos)
        assert plain.tokens == expected[:size]
        for name, (ids, make) in _batched_kinds(target, small).items():
            result = batched_generate(runners[tuple(ids)], rows, 24, greedy, eos, make(size))
            assert result.tokens == expected[:size], (name, size)
            assert result.ttft_seconds <= min(result.finish_seconds) and result.tokens_per_s > 0 and result.num_rounds > 0
    assert any(len(t) < 24 for t in expected) and any(len(t) == 24 for t in expected)   # EOS did split the rows
    # the cache length the sweep allocates holds rows that overshoot max_new_tokens in their last round
    # and idle while others decode (always-right drafts: every round commits the whole chain)

    class Oracle:
        tree_cfg, batch_size = chain_config(7), 3

        def __init__(self, continuations):
            self.continuations = continuations

        def reset(self):
            self.seen = [0] * self.batch_size

        def begin_rows(self, rows, prompts):
            for r, p in zip(rows, prompts):
                self.seen[r] = 1 - len(p)      # extend carries prompt[1:], then generated tokens from the root on

        def commit(self, commits):
            for r, n in enumerate(commits.counts):
                self.seen[r] += n

        def draft_trees(self, roots):
            return [chain_tree(root, torch.tensor(c[s:s + 7])) for root, c, s in zip(roots, self.continuations, self.seen)]

    long = [torch.arange(n) % 5 for n in (9, 4, 17)]
    oracle = [plain_generate(single, p, 40, greedy, set()).tokens for p in long]
    tight = BatchRunner(target, 3, batch_max_len(long, 10, 8), layers)
    result = batched_generate(tight, long, 10, greedy, set(), Oracle(oracle))
    assert result.tokens == [o[:10] for o in oracle] and all(a == [7, 7] for a in result.accept_lengths)


@pytest.mark.parametrize("name", ["eagle3 tree", "medusa", "eagle3 chain", "plain"])
def test_batched_sampling_follows_the_target(tiny_pair, name):
    """Sampled speculative decoding of 4 rows at once (the same prompt in every row, one batched drafter):
    the first two tokens follow the target's exact joint distribution (drafts sampled with proposals too; chains, and
    plain decoding's roots, verified for every row in one pass, `verify_sampling_rows`)."""
    import torch

    from draftsmith.runtime.batched import BatchRunner, batched_generate
    from conftest import two_token_joint
    from draftsmith.runtime.verify import SamplingConfig
    target, small = tiny_pair
    ids, make = _batched_kinds(target, small)[name] if name != "plain" else ([], lambda b: None)
    cfg, B, num_samples = SamplingConfig(temperature=1.0, top_k=4), 4, 1600
    prompt = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(11))
    joint = two_token_joint(target, prompt, cfg)
    runner, drafter, gen, counts = BatchRunner(target, B, 64, list(ids)), make(B), torch.Generator().manual_seed(0), {}
    for _ in range(num_samples // B):
        for row in batched_generate(runner, [prompt] * B, 2, cfg, set(), drafter, gen).tokens:
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    tv = 0.5 * sum(abs(counts.get(k, 0) / num_samples - joint.get(k, 0.0)) for k in set(joint) | set(counts))
    assert set(counts) <= set(joint) and tv < 0.07, tv


def test_ngram_prompt_lookup():
    import torch

    from draftsmith.runtime.baselines import NgramDrafter
    drafter = NgramDrafter(3, max_ngram=3, min_ngram=1)
    drafter.begin(torch.tensor([5, 1, 2]))
    drafter.extend(torch.tensor([1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 1, 2, 3]))   # context 5 [1 2 3 4 9] [1 2 3 7 8] 1 2 3
    assert drafter.lookup() == [7, 8, 1]           # the most recent earlier occurrence of the suffix 1 2 3
    tree = drafter.draft_tree(torch.tensor(3))
    assert tree.tokens_N.tolist() == [3, 7, 8, 1] and tree.parent_N.tolist() == [-1, 0, 1, 2]
    drafter.extend(torch.tensor([42]))             # nothing ended in 42 before
    assert drafter.lookup() == [] and len(drafter.draft_tree(torch.tensor(42))) == 1
    with pytest.raises(ValueError, match="ngram_min"):
        NgramDrafter(2, max_ngram=1, min_ngram=2)


def test_economics_sweep_report_and_model_card(tmp_path, micro_pipeline, monkeypatch):
    """`draftsmith economics` on the micro pipeline, killed after its first batch size and resumed there:
    every figure of economics.json recomputes from its cells; the schedule is the writer's on the measured
    grid; the export's model card serves the best K."""
    import json

    from conftest import micro_recipe

    from draftsmith.runtime import sweep as sweep_mod
    from draftsmith.runtime.export import export_head
    from draftsmith.runtime.sweep import run_economics
    recipe = micro_pipeline
    over = ["economics.batch_sizes=[1,2,64]", "economics.num_speculative_tokens=[1,2]", "economics.max_new_tokens=8",
            "economics.num_prompts=3", f"economics.draft_model={tmp_path / 'draft'}", "economics.draft_model_embedded.hidden_size=32",
            "economics.draft_model_embedded.num_hidden_layers=1", "economics.draft_model_embedded.max_steps=5"]
    r = micro_recipe(recipe.out_dir, recipe.target.model, *over)
    measured, run_batch = [], sweep_mod.Sweep.run_batch

    def killed_at_2(self, size, *args):
        if size == 2:
            raise KeyboardInterrupt  # what a kill leaves: batch size 1 measured and saved
        measured.append(size)
        return run_batch(self, size, *args)
    monkeypatch.setattr(sweep_mod.Sweep, "run_batch", killed_at_2)
    with pytest.raises(KeyboardInterrupt):
        run_economics(r, gpu_hour_usd=2.0, extra_usd_per_hour=0.5, out=str(tmp_path / "econ"))
    assert (tmp_path / "econ" / "partial.json").exists() and measured == [1]
    monkeypatch.setattr(sweep_mod.Sweep, "run_batch", lambda self, size, *a: measured.append(size) or run_batch(self, size, *a))
    out = run_economics(r, gpu_hour_usd=2.0, extra_usd_per_hour=0.5, out=str(tmp_path / "econ"))
    assert measured == [1, 2, 64] and not (tmp_path / "econ" / "partial.json").exists()
    data = json.loads((tmp_path / "econ" / "economics.json").read_text())
    assert (tmp_path / "draft" / "manifest.json").exists()          # the embedded draft model was built on first use
    assert data["batch_sizes"] == [1, 2, 64] and set(data["drafters"]) == {"eagle3", "ngram", "draft-model"}
    assert data["plain_baseline"] == sweep_mod.PLAIN_BASELINE       # sweeps before the one-pass plain baseline read as such
    for name, d in data["drafters"].items():
        assert d["exact_rows"] == d["rows"] > 0, name
        grid = {int(b): {0: data["plain"][b]["tokens_per_s"]} | {int(k): c["tokens_per_s"] for k, c in cells.items()}
                for b, cells in d["cells"].items()}
        assert d["schedule"] == E.schedule(grid) == d["vllm_speculative_config"]["num_speculative_tokens_per_batch_size"]
        for b, cost in d["cost"].items():
            plain = data["plain"][b]["tokens_per_s"]
            spec = grid[int(b)][cost["k"]]
            assert cost["plain_usd_per_mtok"] == pytest.approx(2.0 * 1e6 / (plain * 3600))
            assert cost["spec_usd_per_mtok"] == pytest.approx(2.5 * 1e6 / (spec * 3600))
            assert cost["break_even_extra_usd_per_hour"] == pytest.approx(2.0 * (spec / plain - 1))
        low = d["low_batch"]
        cell = d["cells"]["1"][str(low["k"])]
        assert low["tau"] == cell["tau"] and low["predicted_walltime_factor"] == pytest.approx(low["tau"] / (low["k"] * d["c"] + 1))
        assert low["measured_walltime_factor"] == pytest.approx(cell["tokens_per_s"] / data["plain"]["1"]["tokens_per_s"])
        for b, x in d["by_batch_size"].items():          # c(B) and the refit recomputed from the cells
            c, p = d["cells"][b][str(x["k"])], data["plain"][b]
            assert x["c"] == pytest.approx(c["draft_seconds"] / max(c["num_rounds"], 1) / x["k"] / (p["seconds"] / max(p["num_rounds"], 1)))
            assert x["predicted_walltime_factor"] == pytest.approx(c["tau"] / (x["k"] * x["c"] + 1))
            assert x["draft_ms_per_round"] == pytest.approx(1e3 * c["draft_seconds"] / max(c["num_rounds"], 1))
    assert out["schedule"] == data["drafters"]["eagle3"]["schedule"]
    report = (tmp_path / "econ" / "economics.md").read_text()
    assert (tmp_path / "econ" / "throughput.png").exists() and "Drafters side by side" in report and "c(B)" in report
    # the model card of an export next to this economics report serves the measured K and carries the schedule
    head = recipe.run_dir / "head"
    placed = recipe.run_dir / "economics" / "economics.json"
    placed.parent.mkdir(exist_ok=True)
    placed.write_text(json.dumps(data))
    try:
        card = export_head(str(head), "sglang", str(tmp_path / "sg"), allow_unvalidated=True)["out"]
    finally:
        placed.unlink()  # the micro pipeline is shared: other exports keep the kind's default K
    text = (tmp_path / "sg" / "README.md").read_text()
    k = data["drafters"]["eagle3"]["low_batch"]["k"]
    assert card and f"--speculative-num-steps {k} " in text and json.dumps(data["drafters"]["eagle3"]["schedule"]) in text
    with pytest.raises(ValueError, match="economics.batch_sizes"):
        run_economics(micro_recipe(recipe.out_dir, recipe.target.model, *over, "economics.memory_fraction=1e-12"), out=str(tmp_path / "x"))


def test_economics_compares_heads_in_one_sweep(tmp_path, micro_pipeline, monkeypatch):
    """`economics.compare`: other heads for the same target swept in the same batches as the recipe's head, each
    named by its run and summarised with its own kind; `economics.repeats` measures every cell that many times in
    turn, plain decoding between the drafters."""
    import json
    import shutil

    from conftest import micro_recipe

    from draftsmith import artifacts
    from draftsmith.heads.dflash.model import DFlashHead, draft_config_from_target
    from draftsmith.runtime import sweep as sweep_mod
    from draftsmith.runtime.sweep import run_economics
    from draftsmith.targets.loading import load_target
    recipe = micro_pipeline
    shutil.copytree(recipe.run_dir / "head", tmp_path / "same-weights" / "head")
    _, meta = artifacts.load_checkpoint(recipe.run_dir / "head")
    layer_ids = meta["draft_config"]["draftsmith"]["layer_ids"]
    target = load_target(recipe, torch.device("cpu"))
    dflash = DFlashHead(draft_config_from_target(target.config, layer_ids[1:] + [1], 1, 4, None))  # other layers
    artifacts.save_checkpoint(tmp_path / "block" / "head", dflash.trainable_state(),
                              {"kind": "dflash", "target_id": recipe.target.model, "layer_ids": layer_ids[1:] + [1],
                               "draft_config": dflash.config, "step": 1})
    from draftsmith.runtime.sweep import _columns
    from draftsmith.runtime.target import TargetRunner
    own, union, prompt = layer_ids[1:] + [1], sorted(set(layer_ids) | {1}), torch.arange(3, 9)
    _, captured, _ = TargetRunner(target, 16, union, compile_mode=None).prefill(prompt)
    _, alone, _ = TargetRunner(target, 16, own, compile_mode=None).prefill(prompt)  # what the head reads in a sweep of its own
    torch.testing.assert_close(captured[..., _columns(own, union, target.config.hidden_size)], alone)
    compare = f"economics.compare=[{tmp_path / 'same-weights' / 'head'},{tmp_path / 'block' / 'head'}]"
    over = ["economics.batch_sizes=[1,2]", "economics.num_speculative_tokens=[2]", "economics.max_new_tokens=8",
            "economics.num_prompts=3", "economics.baselines=[]", "economics.repeats=2", compare]
    calls = []
    real = sweep_mod.batched_generate

    def counted(runner, prompts, max_new, cfg, eos, drafter=None):
        calls.append(type(drafter).__name__ if drafter is not None else "plain")
        return real(runner, prompts, max_new, cfg, eos, drafter)
    monkeypatch.setattr(sweep_mod, "batched_generate", counted)
    run_economics(micro_recipe(recipe.out_dir, recipe.target.model, *over), out=str(tmp_path / "econ"))
    data = json.loads((tmp_path / "econ" / "economics.json").read_text())
    assert list(data["drafters"]) == ["eagle3", "same-weights", "block"]
    assert data["drafters"]["block"]["kind"] == "dflash" and data["drafters"]["same-weights"]["kind"] == "eagle3"
    assert data["drafters"]["block"]["vllm_speculative_config"]["method"] == "dflash"
    for name, d in data["drafters"].items():
        assert d["exact_rows"] == d["rows"] > 0, name
    for b in ("1", "2"):  # the same weights draft the same tokens in the same batches
        assert data["drafters"]["same-weights"]["cells"][b]["2"]["tau"] == data["drafters"]["eagle3"]["cells"][b]["2"]["tau"]
    groups = {1: 3, 2: 2}  # batches that cover the 3 prompts at each batch size; per size: a warm-up batch, the
    assert calls.count("ReadingLayers") == 3 * 2 * sum(groups.values())  # the heads read the union's columns
    assert calls.count("plain") == sum(1 + 7 * n for n in groups.values())  # plain batches, then twice: each drafter, plain
    cases = {f"economics.compare=[{tmp_path / 'nowhere'}]": "is not a directory",
             f"economics.compare=[{tmp_path / 'block' / 'head'},{tmp_path / 'block' / 'head'}]": "is named 'block', which another",
             "economics.repeats=0": "economics.repeats=0"}
    from draftsmith.heads.medusa.model import MedusaHead
    from draftsmith.heads.medusa.model import draft_config_from_target as medusa_config
    from draftsmith.recipe import HeadConfig
    medusa = MedusaHead(medusa_config(target.config, HeadConfig(kind="medusa", num_heads=2, num_layers=1)))
    artifacts.save_checkpoint(tmp_path / "heads-on-final" / "head", medusa.trainable_state(),
                              {"kind": "medusa", "target_id": recipe.target.model, "layer_ids": [],
                               "draft_config": medusa.config, "step": 1})
    cases[f"economics.compare=[{tmp_path / 'heads-on-final' / 'head'}]"] = "read the final hidden state and heads that read"
    for override, message in cases.items():
        with pytest.raises(ValueError, match=message):
            run_economics(micro_recipe(recipe.out_dir, recipe.target.model, *over[:-1], override), out=str(tmp_path / "x"))


def test_a_cells_speedup_is_paired_with_the_plain_runs_beside_it(tmp_path, micro_pipeline, monkeypatch):
    """On a machine that slows down run after run, a drafter twice as fast as plain decoding at every moment measures
    2x: each speculative run is set against the plain runs on either side of it, not against plain decoding's fastest
    run, which came earlier on a faster machine (that ratio would be below 2)."""
    import json

    from conftest import micro_recipe

    from draftsmith.runtime import sweep as sweep_mod
    from draftsmith.runtime.sweep import run_economics
    recipe = micro_pipeline
    real, clock = sweep_mod.batched_generate, []

    def drifting(runner, prompts, max_new, cfg, eos, drafter=None):
        result = real(runner, prompts, max_new, cfg, eos, drafter)
        clock.append(drafter)  # the machine is 10% slower at each call; a speculative run takes half plain's time
        result.seconds = (0.5 if drafter is not None else 1.0) * (1 + 0.1 * len(clock))
        return result
    monkeypatch.setattr(sweep_mod, "batched_generate", drifting)
    over = ["economics.batch_sizes=[3]", "economics.num_speculative_tokens=[2]", "economics.max_new_tokens=8",
            "economics.num_prompts=3", "economics.baselines=[]", "economics.repeats=3"]
    run_economics(micro_recipe(recipe.out_dir, recipe.target.model, *over), out=str(tmp_path / "econ"))
    data = json.loads((tmp_path / "econ" / "economics.json").read_text())
    plain = data["plain"]["3"]["tokens_per_s"]
    for k, cell in data["drafters"]["eagle3"]["cells"]["3"].items():
        assert cell["num_exact_rows"] == cell["num_rows"] and cell["tokens_per_s"] / plain == pytest.approx(2.0), k
        assert cell["speedup"] == pytest.approx(2.0) and cell["measured_tokens_per_s"] / plain < 1.9, k
    assert data["drafters"]["eagle3"]["crossover_batch_size"] is None


def test_economics_bad_input_is_named(tmp_path):
    """Recipe keys, prices and a draft model with another vocabulary each get an error naming them."""
    from conftest import MICRO, micro_recipe
    from draftsmith import recipe as recipe_mod
    from draftsmith.runtime.baselines import check_shared_tokenizer
    from draftsmith.runtime.sweep import run_economics
    cases = {"economics.draft_model_embedded.hidden_size=32": "economics.draft_model_embedded needs",
             "economics.batch_sizes=[0,4]": r"economics.batch_sizes=\[0, 4\]: expected batch sizes >= 1",
             "economics.baselines=[medusa]": "economics.baselines: 'medusa' is not one of",
             "economics.num_speculative_tokens=[-1]": "economics.num_speculative_tokens"}
    for override, message in cases.items():
        with pytest.raises(recipe_mod.RecipeError, match=message):
            recipe_mod.load(MICRO, [override])
    recipe = micro_recipe(tmp_path, tmp_path / "never-loaded")
    with pytest.raises(ValueError, match="--gpu-hour-usd=-1.0"):
        run_economics(recipe, gpu_hour_usd=-1.0)

    class Vocab:
        def __init__(self, words):
            self.words = {w: i for i, w in enumerate(words)}

        def get_vocab(self):
            return self.words

        def __len__(self):
            return len(self.words)
    check_shared_tokenizer(Vocab("abc"), Vocab("abc"), "economics.draft_model=x")
    with pytest.raises(ValueError, match="economics.draft_model=x: this draft model's tokenizer differs"):
        check_shared_tokenizer(Vocab("abc"), Vocab("acb"), "economics.draft_model=x")


def test_validate_several_prompt_sets_report_each_domain(tmp_path, micro_pipeline):
    """`validate.prompts` as several sets (a file and a builtin one), each its own domain, shared evenly and
    taken in turn; per domain: tau, acceptance by depth and the speedups over plain decoding and `generate`."""
    import json

    from conftest import micro_recipe

    from draftsmith.runtime.loading import validation_prompts
    from draftsmith.runtime.validate import run_validate
    from draftsmith.targets.loading import load_tokenizer
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Write function {i}."}) + "\n" for i in range(5)))
    recipe = micro_pipeline
    sets = f'validate.prompts=[{{path: {path}}}, {{path: "builtin:math"}}, {{path: "builtin:chat", domain: talk}}]'
    r = micro_recipe(recipe.out_dir, recipe.target.model, sets, "validate.num_prompts=6", "validate.max_new_tokens=8")
    chosen = validation_prompts(r, load_tokenizer(r), 4)
    assert [d for _, d, _ in chosen] == ["questions", "math", "talk", "questions"]
    assert run_validate(r, out=str(tmp_path / "v"))["exact_match"]
    result = json.loads((tmp_path / "v" / "validation.json").read_text())
    assert {d: s["num_prompts"] for d, s in result["per_domain"].items()} == {"questions": 2, "math": 2, "talk": 2}
    for stats in result["per_domain"].values():
        assert stats["speedup_vs_plain"] > 0 and stats["speedup_vs_hf_generate"] > 0
        assert len(stats["acceptance_per_depth"]) == r.validate.depth
    report = (tmp_path / "v" / "report.md").read_text()
    assert "| math | 2 |" in report and "| talk | 2 |" in report
    assert isinstance(result["warnings"], list)
    if result["speedup_vs_plain"] < 1:
        assert "SLOWER than plain decoding" in result["warnings"][0] and "WARNING" in report


def test_depth_speedups_follow_the_verify_cost():
    """A chain's predicted speedup: tokens per round over drafting plus verifying that many tokens. Where a
    verify forward costs one decode step whatever its length (a GPU), deeper pays while acceptance holds; where
    it grows with the tokens verified (a CPU), a shorter chain wins, and with poor acceptance none pays."""
    alpha = [0.8, 0.7, 0.6, 0.5]
    flat = E.depth_speedups(alpha, 0.05, [1.0] * 5)
    assert flat[0] == 1.0 and flat[1] == pytest.approx(1.8 / 1.05)
    assert flat[4] == pytest.approx((1 + 0.8 + 0.56 + 0.336 + 0.168) / (4 * 0.05 + 1))
    assert max(flat, key=flat.get) == 4
    steep = E.depth_speedups(alpha, 0.05, [1.0, 1.3, 1.6, 1.9, 2.2])
    assert max(steep, key=steep.get) == 2 and steep[2] == pytest.approx(2.36 / 1.7)
    poor = E.depth_speedups([0.2, 0.1], 0.05, [1.0, 1.3, 1.6])
    assert max(poor, key=poor.get) == 0


def test_verify_costs_are_measured_per_tokens_verified(micro_target):
    import torch
    from transformers import AutoModelForCausalLM
    from draftsmith.runtime.target import TargetRunner
    from draftsmith.runtime.timing import verify_costs
    model = AutoModelForCausalLM.from_pretrained(micro_target).eval()
    runner = TargetRunner(model, 64, [1, 2, 3])
    costs = verify_costs(runner, torch.arange(1, 9), 4)
    assert len(costs) == 4 and costs[0] == 1.0 and all(v > 0 for v in costs)
