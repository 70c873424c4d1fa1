"""The runtime: exactness against plain greedy decoding, scripted stub drafters, lossless
sampling (statistical), tree invariants (hypothesis)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.heads.eagle3.model import Eagle3Head, draft_config_from_target
from draftsmith.heads.drafting import TreeConfig
from draftsmith.heads.eagle3.draft import Eagle3Drafter
from draftsmith.heads.tree import Tree, ancestor_mask, assemble_tree, chain_tree, static_tree
from draftsmith.runtime.compile import step_compiler
from draftsmith.runtime.generate import plain_generate, speculative_generate
from draftsmith.runtime.target import TargetRunner
from draftsmith.runtime.verify import SamplingConfig, processed_probs, verify_greedy, verify_greedy_rows, verify_sampling, verify_sampling_rows
from conftest import two_token_total_variation

GREEDY = SamplingConfig()
LAYERS = [2, 3, 4]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    return model, TargetRunner(model, 256, LAYERS)


def random_head(model, draft_vocab=48, seed=0):
    torch.manual_seed(seed)
    head = Eagle3Head(draft_config_from_target(model.config, draft_vocab, LAYERS)).eval()
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[torch.randperm(model.config.vocab_size)[:draft_vocab]] = True
    head.set_vocab(t2d.nonzero().flatten() - torch.arange(draft_vocab), t2d)
    head.load_target_weights(model.get_input_embeddings().weight)
    return head


class ScriptedDrafter:
    """Proposes chains from a known continuation: `always` right, `never` right, or right for the
    first `partial` tokens of each round then wrong; siblings are wrong tokens."""

    def __init__(self, oracle: list[int], mode: str, depth: int, vocab: int, partial: int = 2, width: int = 2):
        self.oracle, self.mode, self.depth, self.vocab, self.partial, self.width = oracle, mode, depth, vocab, partial, width
        self.emitted = 0

    def reset(self):
        self.emitted = 0

    def extend(self, tokens, aux):
        self.emitted += len(tokens)

    def draft_tree(self, root):
        start = self.emitted - self.prompt_len + 1  # next oracle index after the root
        right = self.oracle[start:start + self.depth]
        right += [0] * (self.depth - len(right))
        good = {"always": self.depth, "never": 0, "partial": self.partial}[self.mode]
        chain = [t if i < good else (t + 1) % self.vocab for i, t in enumerate(right)]
        tokens, parent, depth, prev = [int(root)], [-1], [0], 0
        for i, t in enumerate(chain):
            tokens.append(t)
            parent.append(prev)
            depth.append(i + 1)
            node = len(tokens) - 1
            for w in range(1, self.width):  # wrong siblings hanging off the same parent
                tokens.append((t + 1 + w) % self.vocab)
                parent.append(prev)
                depth.append(i + 1)
            prev = node
        parent_t, depth_t = torch.tensor(parent), torch.tensor(depth)
        return Tree(torch.tensor(tokens), parent_t, depth_t, ancestor_mask(parent_t, depth_t))


@pytest.mark.parametrize("mode,expected", [("always", 5), ("never", 0), ("partial", 2)])
def test_scripted_stub_drafters(tiny, mode, expected):
    model, runner = tiny
    prompt = torch.randint(0, 96, (9,))
    base = plain_generate(runner, prompt, 30, GREEDY, set())
    stub = ScriptedDrafter(base.tokens, mode, depth=5, vocab=96)
    stub.prompt_len = len(prompt)
    spec = speculative_generate(runner, stub, prompt, 30, GREEDY, set())
    assert spec.tokens == base.tokens
    assert all(a == expected for a in spec.accept_lengths[:-1])  # the last round may be cut by max tokens


@pytest.mark.parametrize("depth,top_k,nodes", [(1, 1, 2), (6, 1, 7), (3, 2, 6), (4, 4, 16), (6, 8, 40), (2, 10, 60)])
def test_greedy_speculative_equals_plain_greedy(tiny, depth, top_k, nodes):
    model, runner = tiny
    head = random_head(model, seed=depth)
    drafter = Eagle3Drafter(head, 256, TreeConfig(depth, top_k, nodes))
    for seed in range(6):
        prompt = torch.randint(0, 96, (3 + 5 * seed,), generator=torch.Generator().manual_seed(seed))
        base = plain_generate(runner, prompt, 40, GREEDY, set())
        spec = speculative_generate(runner, drafter, prompt, 40, GREEDY, set())
        assert spec.tokens == base.tokens
        hf = model.generate(prompt[None], max_new_tokens=40, do_sample=False)[0, len(prompt):].tolist()
        assert base.tokens == hf


@pytest.mark.parametrize("depth,nodes", [(6, 7), (6, 4), (1, 2)])
def test_chain_drafting_builds_the_dynamic_tree_with_top_k_1(tiny, depth, nodes):
    model, runner = tiny
    drafter = Eagle3Drafter(random_head(model, seed=11), 256, TreeConfig(depth, 1, nodes))
    prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(3))
    runner.reset()
    _, aux, _ = runner.prefill(prompt)
    drafter.reset()
    drafter.extend(prompt[1:], aux[:-1])
    chain, general = drafter.draft_chains(prompt[-1:])[0], drafter.draft_dynamic(prompt[-1:])[0]
    assert len(chain) == min(depth + 1, nodes)
    for key in ("tokens_N", "parent_N", "depth_N", "mask_NN"):
        assert torch.equal(getattr(chain, key), getattr(general, key)), key


def test_plain_runtime_matches_huggingface_logits(tiny):
    model, runner = tiny
    prompt = torch.randint(0, 96, (12,))
    runner.reset()
    logits, _, _ = runner.prefill(prompt)  # the prefill makes its last position's logits only
    reference = model(torch.cat([prompt, prompt[:3]])[None]).logits[0].float()
    torch.testing.assert_close(logits, reference[len(prompt) - 1:len(prompt)], atol=1e-5, rtol=1e-5)
    one = torch.ones(1, 1, dtype=torch.bool)
    for i in range(3):  # decode steps attend over the filled slots only (FilledLayer), as generate's dynamic cache
        step, _, _ = runner.forward(prompt[i:i + 1], torch.zeros(1, dtype=torch.long), one)
        runner.commit(torch.zeros(1, dtype=torch.long))
        torch.testing.assert_close(step, reference[len(prompt) + i:len(prompt) + i + 1], atol=1e-5, rtol=1e-5)
    assert runner.trim and {layer.visible for layer in runner.filled} == {len(prompt) + 3}  # the last step's filled slots


def test_eos_inside_accepted_block_stops_output(tiny):
    model, runner = tiny
    prompt = torch.randint(0, 96, (9,))
    base = plain_generate(runner, prompt, 30, GREEDY, set())
    eos = base.tokens[7]
    stub = ScriptedDrafter(base.tokens, "always", depth=5, vocab=96)
    stub.prompt_len = len(prompt)
    spec = speculative_generate(runner, stub, prompt, 30, GREEDY, {eos})
    assert spec.tokens == base.tokens[:base.tokens.index(eos) + 1]
    assert plain_generate(runner, prompt, 30, GREEDY, {eos}).tokens == spec.tokens


def test_max_new_tokens_cuts_inside_a_block(tiny):
    model, runner = tiny
    prompt = torch.randint(0, 96, (9,))
    base = plain_generate(runner, prompt, 11, GREEDY, set())
    stub = ScriptedDrafter(plain_generate(runner, prompt, 40, GREEDY, set()).tokens, "always", depth=5, vocab=96)
    stub.prompt_len = len(prompt)
    assert speculative_generate(runner, stub, prompt, 11, GREEDY, set()).tokens == base.tokens


# ---------------------------------------------------------------- lossless sampling


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_sampling_follows_target_distribution_on_toy(seed):
    """One target distribution at the root; children are deterministic drafts (good and bad ones).
    The first emitted token must be distributed as the processed target distribution."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 8
    logits = torch.randn(4, vocab, generator=gen) * 2
    cfg = SamplingConfig(temperature=0.8, top_k=6, top_p=0.9)
    p = processed_probs(logits[0], cfg)
    children = torch.argsort(p, descending=True)[[0, 3, 7]]  # a likely, a middling and an impossible draft
    tree = Tree(torch.cat([torch.tensor([0]), children]), torch.tensor([-1, 0, 0, 0]), torch.tensor([0, 1, 1, 1]),
                ancestor_mask(torch.tensor([-1, 0, 0, 0]), torch.tensor([0, 1, 1, 1])))
    counts = torch.zeros(vocab)
    for _ in range(20000):
        path, bonus = verify_sampling(tree, logits, cfg, gen)
        first = tree.tokens_N[path[1]] if len(path) > 1 else bonus
        counts[first] += 1
    expected_counts = p * counts.sum()
    seen = expected_counts > 0
    chi2 = (((counts - expected_counts) ** 2)[seen] / expected_counts[seen]).sum().item()
    assert counts[~seen].sum() == 0          # never emits what top-k/top-p removed
    assert chi2 < 30.0                       # dof <= 5: p-value far below 1e-4 at this bound
    assert _tv(counts, p) < 0.02


def _chain_outcomes(tokens_N: torch.Tensor, size: int, probs_NV: torch.Tensor) -> dict:
    """The exact law of (accepted nodes, bonus token) of one chain under `verify_sampling`'s rule: j drafts accepted with
    probability prod_{i<j} p_i(x_{i+1}), then the bonus y from p_j (y != x_{j+1} where draft j + 1 was refused)."""
    law, reach = {}, 1.0
    for j in range(size):
        for y in range(probs_NV.shape[-1]):
            if j + 1 < size and y == tokens_N[j + 1]:
                continue
            law[(j + 1, y)] = law.get((j + 1, y), 0.0) + reach * probs_NV[j, y].item()
        if j + 1 < size:
            reach *= probs_NV[j, tokens_N[j + 1]].item()
    return law


def test_batched_chain_sampling_follows_the_exact_rule():
    """`verify_sampling_rows` (every row's chain in one pass) against the exact law of verify_sampling's rule: rows of
    four sizes at once (a root alone, as plain decoding; drafts likely, middling and outside top-k), 6000 rows each;
    the paths list each row's accepted nodes root first."""
    gen = torch.Generator().manual_seed(0)
    vocab, N = 8, 4
    logits = torch.randn(N, vocab, generator=gen) * 2
    cfg = SamplingConfig(temperature=0.8, top_k=6, top_p=0.95)
    probs = processed_probs(logits, cfg)
    order = torch.argsort(probs, dim=-1, descending=True)
    chain = torch.tensor([3, order[0, 0], order[1, 2], order[2, 7]])   # likely, middling, then a draft top-k removed
    sizes, rows = [1, 2, 3, 4], 6000
    B = rows * len(sizes)
    tokens = chain.expand(B, N).clone()
    sizes_B = torch.tensor(sizes).repeat_interleave(rows)
    paths, counts, bonus = verify_sampling_rows(tokens, sizes_B, logits.expand(B, N, vocab), cfg, gen)
    assert bool((counts <= sizes_B).all()) and bool((paths[:, 0] == 0).all())
    assert bool((paths == torch.arange(paths.shape[1])).all())
    for g, size in enumerate(sizes):
        seen = {}
        for c, y in zip(counts[g * rows:(g + 1) * rows].tolist(), bonus[g * rows:(g + 1) * rows].tolist()):
            seen[(c, y)] = seen.get((c, y), 0) + 1
        law = _chain_outcomes(chain, size, probs)
        assert all(law.get(k, 0.0) > 0 for k in seen), (size, seen)   # never an outcome the rule cannot give
        tv = 0.5 * sum(abs(seen.get(k, 0) / rows - law.get(k, 0.0)) for k in set(law) | set(seen))
        assert tv < 0.04, (size, tv)       # <= 20 outcomes, 6000 samples: noise alone gives ~0.02


@pytest.mark.long
def test_sampled_speculative_matches_plain_sampling_on_model(tiny):
    """Distribution of the first two generated tokens, speculative vs the target's own (exact) joint."""
    model, runner = tiny
    head = random_head(model, draft_vocab=96, seed=3)
    drafter = Eagle3Drafter(head, 256, TreeConfig(3, 4, 10))
    cfg = SamplingConfig(temperature=1.0, top_k=5)
    prompt = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(11))
    tv, support_ok = two_token_total_variation(model, runner, drafter, prompt, cfg, num_samples=2000, seed=0)
    assert support_ok and tv < 0.07   # 25 outcomes, 2000 samples: sampling noise alone gives ~0.035


# ---------------------------------------------------------------- tree invariants


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(2, 30), st.integers(0, 10_000))
def test_assembled_trees_are_ancestor_closed(depth, top_k, num_nodes, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens, parents, scores, depths = [], [], [], []
    frontier = [(-1, 0.0)]
    for d in range(1, depth + 1):
        new = []
        for parent, score in frontier:
            logp = torch.log_softmax(torch.randn(top_k, generator=gen), -1)
            if seed % 3 == 0:
                logp = torch.zeros(top_k)  # ties: children equal to their parent's score
            for lp in logp.tolist():
                tokens.append(len(tokens))
                parents.append(parent)
                scores.append(score + lp)
                depths.append(d)
                new.append((len(tokens) - 1, score + lp))
        frontier = sorted(new, key=lambda x: -x[1])[:top_k]
    tree = assemble_tree(torch.tensor(99), torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores),
                         torch.tensor(depths), num_nodes)
    n = len(tree)
    assert n == min(num_nodes, len(tokens) + 1)
    assert tree.parent_N[0] == -1 and tree.depth_N[0] == 0
    for i in range(1, n):
        p = int(tree.parent_N[i])
        assert 0 <= p < i                                       # topological order, parent present
        assert tree.depth_N[i] == tree.depth_N[p] + 1
        expected = tree.mask_NN[p].clone()
        expected[i] = True
        assert torch.equal(tree.mask_NN[i], expected)           # mask = self + ancestors


def test_static_tree_from_choices_and_chain():
    topk = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    tree = static_tree(torch.tensor(1), [[0], [1], [0, 0], [0, 1], [0, 0, 2]], topk)
    assert tree.tokens_N.tolist() == [1, 10, 11, 20, 21, 32]
    assert tree.parent_N.tolist() == [-1, 0, 0, 1, 1, 3]
    assert tree.depth_N.tolist() == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="lacks its parent"):
        static_tree(torch.tensor(1), [[0, 1]], topk)
    chain = chain_tree(torch.tensor(5), torch.tensor([6, 7]))
    assert chain.mask_NN.tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_greedy_verify_on_hand_built_tree():
    #        0
    #      /   \
    #     1(a)  2(b)
    #     |
    #     3(c)
    parent = torch.tensor([-1, 0, 0, 1])
    depth = torch.tensor([0, 1, 1, 2])
    tree = Tree(torch.tensor([9, 4, 5, 6]), parent, depth, ancestor_mask(parent, depth))
    logits = torch.full((4, 10), -5.0)
    logits[0, 5] = 5  # target wants b after the root
    logits[2, 7] = 5  # and 7 after b
    path, bonus = verify_greedy(tree, logits)
    assert path.tolist() == [0, 2] and bonus.item() == 7
    logits[0, 4], logits[0, 5], logits[1, 6], logits[3, 8] = 9, 5, 5, 5
    path, bonus = verify_greedy(tree, logits)
    assert path.tolist() == [0, 1, 3] and bonus.item() == 8


def test_greedy_verification_of_a_batch_matches_each_rows_own():
    """The batched runtime verifies every row's padded tree in one pass (`verify_greedy_rows`): the same accepted path
    and bonus token as `verify_greedy` on each tree alone, for trees and chains of different sizes, padding after each
    row's own nodes (whose tokens would match the target if padding were read), drafts that are all accepted and none."""
    from draftsmith.runtime.batched import pad_trees
    gen = torch.Generator().manual_seed(0)
    V, trees, logits = 5, [], []
    for b in range(40):
        n = 1 + b % 9
        parent = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])
        if b % 3 == 0:
            parent = torch.arange(-1, n - 1)                                            # a chain
        depth = torch.zeros(n, dtype=torch.long)
        for i in range(1, n):
            depth[i] = depth[parent[i]] + 1
        row_logits = torch.randn(12, V, generator=gen)
        tokens = torch.randint(0, V, (n,), generator=gen)
        if b % 4 == 1:                                                                   # the target agrees with every draft
            tokens[1:] = row_logits[parent[1:]].argmax(-1)
        trees.append(Tree(tokens, parent, depth, ancestor_mask(parent, depth)))
        logits.append(row_logits)
    padded = pad_trees(trees, "cpu", num_nodes=12)
    logits_BNV = torch.stack(logits)
    logits_BNV[:, :, 0] += 3 * (torch.arange(12) >= padded[4][:, None])                # padding: token 0 would match
    paths, counts, bonus = verify_greedy_rows(*padded[:1], padded[3], padded[1], padded[2], padded[4], logits_BNV)
    assert len(set(counts.tolist())) > 3 and counts.max() > 4
    for b, tree in enumerate(trees):
        path, token = verify_greedy(tree, logits_BNV[b, :len(tree)])
        assert paths[b, :counts[b]].tolist() == path.tolist() and int(bonus[b]) == int(token), b


@pytest.mark.slow
@pytest.mark.long
def test_compiled_fixed_shape_steps_trace_and_stay_exact(tiny):
    """The CUDA-graph path compiles the draft step and the fixed-size verify with torch.compile. Here
    dynamo traces the very same functions (eager backend, CPU): they must compile and stay exact."""
    model, plain_runner = tiny
    runner = TargetRunner(model, 256, LAYERS, compile_mode="eager")
    assert not runner.trim and plain_runner.trim  # a compiled step attends over the whole length: one shape
    drafter = Eagle3Drafter(random_head(model, seed=5), 256, TreeConfig(3, 2, 6), step_compiler("eager", model.device))
    for seed in range(3):
        prompt = torch.randint(0, 96, (7 + seed,), generator=torch.Generator().manual_seed(seed))
        base = plain_generate(plain_runner, prompt, 16, GREEDY, set())
        assert speculative_generate(runner, drafter, prompt, 16, GREEDY, set()).tokens == base.tokens
        assert plain_generate(runner, prompt, 16, GREEDY, set()).tokens == base.tokens


def test_rounds_are_bucketed_by_the_position_they_drafted_at():
    from draftsmith.runtime import validate as V
    assert V._length_bucket(100) == "0-127" and V._length_bucket(5000) == "2048-8191" and V._length_bucket(40000) == ">=32768"
    buckets = V._by_position([[3, 3], [0]], [torch.zeros(125), torch.zeros(600)], depth=4)
    assert buckets["0-127"]["num_rounds"] == 1 and buckets["128-511"]["num_rounds"] == 1   # at 125, then 125 + 4
    assert buckets["512-2047"]["tau"] == 1.0 and list(buckets) == ["0-127", "128-511", "512-2047"]


def test_chains_pad_for_the_batch_as_their_trees_do():
    """Chain drafters hand the batched runtime `Chains` (every row's [root, drafts] as one tensor); `pad_chains` gives
    what `pad_trees` gives for the same chains, with a finished row verifying its root alone."""
    from draftsmith.heads.tree import Chains
    from draftsmith.runtime.batched import pad_chains, pad_trees
    roots, drafts = torch.tensor([4, 8, 1]), torch.tensor([[5, 6, 7], [9, 2, 3], [0, 4, 4]])
    chains = Chains(roots, drafts)
    assert len(chains) == 3 and [t.tokens_N.tolist() for t in chains] == [[4, 5, 6, 7], [8, 9, 2, 3], [1, 0, 4, 4]]
    done = [False, True, False]
    trees = [chain_tree(roots[b], drafts[b][:0]) if done[b] else chains[b] for b in range(3)]
    fast, slow = pad_chains(chains.tokens_BN, done, num_nodes=6), pad_trees(trees, "cpu", num_nodes=6)
    assert fast[4].tolist() == slow[4].tolist() == [4, 1, 4]
    live = [0, 2]
    for got, want in zip(fast[:4], slow[:4]):
        assert torch.equal(got[live], want[live])
    logits = torch.randn(3, 6, 10)
    for got, want in zip(verify_greedy_rows(*fast[:1], fast[3], fast[1], fast[2], fast[4], logits),
                         verify_greedy_rows(*slow[:1], slow[3], slow[1], slow[2], slow[4], logits)):
        assert torch.equal(got[live], want[live])
