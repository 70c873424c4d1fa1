"""The runtime on every layer type transformers defines: sliding windows and sinks (gpt-oss, Gemma 2/3,
Mistral, OLMo 3, EXAONE 4, Cohere 2), chunked attention (Llama 4), linear attention and state-space
layers (Qwen3-Next, Qwen3.5, Falcon-H1, Nemotron-H, LFM2). Windows and chunks are 4 tokens, a fraction
of prompt + answer; every output must equal the model's own `generate`, tree or chain, whatever the
drafter gets right. Recurrent targets keep the states after a chain's last accepted position, with a drafter wrong at chosen depths."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from draftsmith.heads.tree import Tree, ancestor_mask
from draftsmith.runtime.batched import BatchRunner, batched_generate
from draftsmith.runtime.generate import plain_generate, speculative_generate
from draftsmith.runtime.target import TargetRunner
from draftsmith.runtime.validate import generate_reference
from draftsmith.runtime.verify import SamplingConfig
from test_modern_targets import ARCHITECTURES, BASE

GREEDY = SamplingConfig()
WINDOWED = ["cohere2", "exaone4", "gemma2", "gemma3_text", "gpt_oss", "llama4_text", "mistral", "olmo3"]
RECURRENT = ["falcon_h1", "lfm2", "nemotron_h", "qwen3_5_text", "qwen3_next"]
# chunks as short as the windows; LFM2's short-convolution layers between its attention layers
EXTRA = {"llama4_text": dict(attention_chunk_size=4),
         "lfm2": dict(layer_types=["conv", "full_attention", "conv", "conv", "full_attention", "conv"])}
PROMPT, NEW, DEPTH = 19, 24, 4
INIT = 0.1  # weights large enough that a wrong window or state changes the argmax (checked)


def tiny_target(model_type: str):
    config = AutoConfig.for_model(model_type, **{**BASE, **ARCHITECTURES[model_type], **EXTRA.get(model_type, {})}, initializer_range=INIT)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None  # random weights: decode the full length
    return model


class CyclingDrafter:
    """Drafts the known continuation, right for the first `right` tokens of round r (r cycling through
    0..depth, so rounds are rejected whole, accepted in part and accepted whole) and wrong after; with
    `width` > 1 each right node has wrong siblings, making a tree."""

    def __init__(self, oracle: list[int], prompt_len: int, depth: int, vocab: int, width: int):
        self.oracle, self.prompt_len, self.depth, self.vocab, self.width = oracle, prompt_len, depth, vocab, width
        self.emitted, self.round = 0, 0

    def reset(self):
        self.emitted, self.round = 0, 0

    def extend(self, tokens, features):
        self.emitted += len(tokens)

    def draft_tree(self, root):
        start = self.emitted - self.prompt_len + 1
        right = (self.oracle[start:start + self.depth] + [0] * self.depth)[:self.depth]
        good = self.round % (self.depth + 1)
        self.round += 1
        tokens, parent, depth, prev = [int(root)], [-1], [0], 0
        for i, t in enumerate(right):
            tokens.append(t if i < good else (t + 1) % self.vocab)
            parent.append(prev)
            depth.append(i + 1)
            node = len(tokens) - 1
            for w in range(1, self.width):
                tokens += [(t + 1 + w) % self.vocab]
                parent.append(prev)
                depth.append(i + 1)
            prev = node
        parent_t, depth_t = torch.tensor(parent), torch.tensor(depth)
        return Tree(torch.tensor(tokens), parent_t, depth_t, ancestor_mask(parent_t, depth_t))


@pytest.mark.parametrize("model_type", WINDOWED + RECURRENT)
def test_speculative_output_equals_generate_on_every_layer_type(model_type):
    model = tiny_target(model_type)
    runner = TargetRunner(model, PROMPT + NEW + 16, [1, 3])
    assert bool(runner.recurrent) == (model_type in RECURRENT)
    eos = set()
    prompt = torch.randint(0, 128, (PROMPT,), generator=torch.Generator().manual_seed(1))
    reference = generate_reference(model, prompt, NEW, eos)[0]
    assert len(reference) == NEW  # several windows past the prompt
    assert plain_generate(runner, prompt, NEW, GREEDY, eos).tokens == reference
    drafter = CyclingDrafter(reference, PROMPT, DEPTH, 128, width=1 if runner.recurrent else 2)
    forwards = []
    hook = runner.extractor.decoder.register_forward_pre_hook(lambda *_: forwards.append(1))
    spec = speculative_generate(runner, drafter, prompt, NEW, GREEDY, eos)
    hook.remove()
    assert spec.tokens == reference
    # one target forward per round however much of a chain is kept: a recurrent target gets the states after
    # the last accepted position by running its recurrent mixers alone over their recorded inputs
    assert len(forwards) == 1 + len(spec.accept_lengths)
    full = [a for a in spec.accept_lengths[:-1]]
    assert {0, DEPTH} <= set(full) and set(full) & set(range(1, DEPTH))  # rejected, partial and whole rounds


def test_a_window_changes_the_output():
    """The windowed tests above could pass on a runtime that ignores windows only if the windows changed
    nothing: with the window widened past the sequence, the same target decodes differently."""
    prompt = torch.randint(0, 128, (PROMPT,), generator=torch.Generator().manual_seed(1))
    windowed = tiny_target("mistral")
    wide = tiny_target("mistral")
    wide.config.sliding_window = 4096
    runner = TargetRunner(wide, PROMPT + NEW + 16, [1, 3])
    assert plain_generate(runner, prompt, NEW, GREEDY, set()).tokens != generate_reference(windowed, prompt, NEW, set())[0]


def test_recurrent_targets_refuse_trees():
    model = tiny_target("qwen3_next")
    runner = TargetRunner(model, 64, [1, 3])
    prompt = torch.randint(0, 128, (PROMPT,), generator=torch.Generator().manual_seed(1))
    tree = CyclingDrafter(list(range(40)), PROMPT, 3, 128, width=2)
    with pytest.raises(ValueError, match="qwen3_next has recurrent layers.*validate.top_k: 1"):
        speculative_generate(runner, tree, prompt, 8, GREEDY, set())
    batched = Rows([CyclingDrafter(list(range(40)), PROMPT, 3, 128, width=2)] * 2, num_nodes=7)
    with pytest.raises(ValueError, match="qwen3_next has recurrent layers.*validate.top_k: 1"):
        batched_generate(BatchRunner(model, 2, 64, [1, 3]), [prompt, prompt], 8, GREEDY, set(), drafter=batched)


class Rows:
    """The batched drafter protocol over one CyclingDrafter per row."""

    def __init__(self, drafters: list[CyclingDrafter], num_nodes: int, phases: list[int] | None = None):
        self.drafters, self.batch_size = drafters, len(drafters)
        self.phases = phases or [0] * len(drafters)  # each row's first round
        self.tree_cfg = type("TreeConfig", (), {"num_nodes": num_nodes})

    def reset(self):
        for d, phase in zip(self.drafters, self.phases):
            d.reset()
            d.round = phase

    def commit(self, commits):
        for b, t, f in commits.rows():
            self.drafters[b].extend(t, f)

    def draft_trees(self, roots):
        return [d.draft_tree(r) for d, r in zip(self.drafters, roots)]


@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1", "lfm2"])
def test_a_recurrent_target_decodes_batched_each_row_keeping_its_own_position(model_type):
    """Rows of different prompt lengths, each drafter wrong at its own depths, so one round keeps whole,
    partial and empty chains side by side (chains padded to more nodes than they have: padding rolls
    back too); every row equals `generate` on its prompt alone."""
    model = tiny_target(model_type)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (PROMPT + extra,), generator=gen) for extra in (0, 5, 2)]
    references = [generate_reference(model, p, NEW, set())[0] for p in prompts]
    drafters = [CyclingDrafter(ref, len(p), DEPTH, 128, width=1) for ref, p in zip(references, prompts)]
    runner = BatchRunner(model, len(prompts), PROMPT + 5 + NEW + 32, [1, 3])
    out = batched_generate(runner, prompts, NEW, GREEDY, set(), drafter=Rows(drafters, DEPTH + 3, phases=[0, 2, 4]))
    assert out.tokens == references
    mixed = [sorted({row[r] for row in out.accept_lengths}) for r in range(min(map(len, out.accept_lengths)) - 1)]
    assert any(len(m) == 3 for m in mixed)  # a round where the rows kept different lengths


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss", "llama4_text", "qwen3_next", "falcon_h1", "lfm2"])
@pytest.mark.parametrize("stop_after_features", [False, True])
def test_capture_in_chunks_equals_one_forward(model_type, stop_after_features):
    """capture.chunk_tokens: a sample several chunks (and windows) long, run in chunks over the model's own cache,
    gives the features (and the final hidden state) of one whole forward, padded rows included."""
    from draftsmith.targets.features import FeatureExtractor
    model = tiny_target(model_type) if model_type != "llama" else AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **BASE, initializer_range=INIT)).eval()
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 29:] = 0  # a shorter sample, right-padded
    whole = FeatureExtractor(model, [1, 3], stop_after_features)(ids, mask)
    chunked = FeatureExtractor(model, [1, 3], stop_after_features, chunk_tokens=8)(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(chunked[0][real], whole[0][real], rtol=1e-4, atol=1e-4)
    if not stop_after_features:
        torch.testing.assert_close(chunked[1][real], whole[1][real], rtol=1e-4, atol=1e-4)


def test_a_chunk_size_below_one_is_refused_naming_the_key():
    from draftsmith import recipe as recipe_mod
    with pytest.raises(recipe_mod.RecipeError, match="capture.chunk_tokens=0"):
        recipe_mod.loads("name: x\ntarget: {model: m}\ncapture: {chunk_tokens: 0}\n")


def test_a_recurrent_layer_without_a_known_mixer_is_refused_by_name():
    from draftsmith.runtime.target import recurrent_mixers
    decoder = torch.nn.Module()
    decoder.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
    decoder.layers[0].mamba = torch.nn.Linear(2, 2)
    assert recurrent_mixers(decoder, ["linear_attention", "full_attention"]) == {0: decoder.layers[0].mamba}
    with pytest.raises(ValueError, match=r"layer 1, a 'conv' layer\): no recurrent mixer found under any of \['linear_attn'"):
        recurrent_mixers(decoder, ["linear_attention", "conv"])
