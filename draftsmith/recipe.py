"""Recipes: one strict dataclass tree per (target, head), loaded from YAML.

Unknown keys and wrong types are errors that name the key path. Any field can be
overridden as a dotted ``section.field=value`` string (the value is parsed as YAML).
This module holds the schema; `draftsmith.typed_yaml` (which imports nothing of draftsmith's own) checks a mapping
against it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from draftsmith.typed_yaml import RecipeError, apply_override, build


@dataclass
class EmbeddedTargetConfig:
    """Shape and budget of the tiny Llama that `draftsmith target` trains on stdlib source."""
    vocab_size: int = 4096  # BPE vocabulary trained on the corpus
    hidden_size: int = 256  # the tiny Llama's width
    intermediate_size: int = 688  # its MLP width
    num_hidden_layers: int = 8  # its decoder layers
    num_attention_heads: int = 8  # its attention heads
    num_key_value_heads: int = 4  # its KV heads (grouped-query attention)
    max_position_embeddings: int = 2048  # its context length
    seq_len: int = 256  # training sequence length (tokens)
    batch_size: int = 16  # training sequences per step
    lr: float = 1.5e-3  # peak learning rate (AdamW, cosine)
    train_seconds: float = 240.0  # wall-clock budget of its training (a cap when max_steps is set)
    max_steps: int | None = None  # set it for a bit-for-bit reproducible target (schedule by steps)
    corpus_mb: float = 6.0  # megabytes of stdlib source to train on
    chat_fraction: float = 0.3  # share of training sequences rendered as chat conversations
    seed: int = 0  # seed of its initialisation and data order
    vision: EmbeddedVisionConfig | None = None  # a vision tower too: the image-text demo target (LLaVA layout)


@dataclass
class EmbeddedVisionConfig:
    """The vision tower of the image-text demo target: a CLIP tower and a projector in front of the tiny Llama
    (LLaVA's layout), trained with it to read images of stdlib source drawn one token a patch and to write the
    function they begin (`draftsmith.targets.code_images`)."""
    grid: int = 8  # tokens a row and rows an image: grid x grid patches, each one image token
    patch_size: int = 24  # pixels a side of a patch (one token's cell)
    hidden_size: int = 64  # the tower's width
    intermediate_size: int = 128  # its MLP width
    num_hidden_layers: int = 2  # its layers
    num_attention_heads: int = 2  # its attention heads
    image_fraction: float = 0.5  # share of the target's training steps on image conversations
    lr: float = 1e-3  # peak learning rate of the tower and the projector (the language model's is the target's lr)


@dataclass
class ParallelConfig:
    """How one replica of the target is laid out over devices (transformers' DistributedConfig):
    tensor-, pipeline- and expert-parallel sizes. Data parallelism is what the world size leaves:
    dp = world / (tp * pp). Override per launch: `target.parallel.tp=4`."""
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    ep: int = 1  # expert-parallel size: 1, or equal to tp


@dataclass
class TargetConfig:
    """The frozen target model: a local directory, a hub id, or a GGUF file (`embedded` builds the demo one)."""
    model: str = ""  # a model directory, hub id, .gguf file (path, org/repo/file.gguf, package:NAME/file.gguf)
    gguf_file: str | None = None        # a GGUF file inside the directory or hub repository `model` (folded into
                                        # `model` as <model>/<file> when the recipe loads); or name the .gguf in `model`
    embedded: EmbeddedTargetConfig | None = None  # build the demo's tiny target at `model` (draftsmith target)
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU (exactness)
    chat_template: str | None = None  # a Jinja chat template replacing the tokenizer's
    attn_implementation: str | None = None  # None: the model's own default (sdpa where it has it, else eager)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # how one replica is laid out over devices


@dataclass
class DataSource:
    path: str = ""  # a .jsonl/.json file, a datasets source (hub id or saved folder), or builtin:NAME
    format: str = "auto"  # auto detects it from the record's keys
    split: str = "train"                # a `datasets` source's split (UltraChat-200K: train_sft)
    name: str | None = None             # a `datasets` source's configuration name
    streaming: bool = False             # read a `datasets` source record by record, never whole on disk or in memory
    max_records: int | None = None      # take at most this many records from this source (its first ones)


@dataclass
class RegenConfig:
    """The target rewrites every assistant turn: in process (batched `generate`), or through an
    OpenAI-compatible chat-completions server (`server`: vLLM, SGLang, TGI, `transformers serve`)."""
    enabled: bool = False  # answer every assistant turn (and every unanswered prompt) with the target
    max_new_tokens: int = 256  # tokens per answer
    batch_size: int = 8                 # in process: conversations per generate batch
    temperature: float = 0.0            # 0: greedy
    top_p: float = 1.0  # nucleus sampling when temperature > 0
    stop: list[str] = field(default_factory=list)  # stop strings (cut from the answer, as servers do)
    server: str | None = None           # base URL, e.g. http://host:8000/v1; None: in process
    api_key_env: str | None = None      # the NAME of an environment variable holding the key, never the key
    served_model: str | None = None     # the server's model id; None: the listed one naming target.model
    concurrency: int = 16               # server: requests in flight
    timeout_s: float = 600.0            # server: per request
    max_retries: int = 8                # server: per request, exponential backoff (connection errors, 5xx, 429)


@dataclass
class DataConfig:
    """Conversations in, tokens plus assistant-only loss masks out."""
    sources: list[DataSource] = field(default_factory=list)  # the conversation sources, read in order
    builtin: str | None = None  # stdlib: the demo's function-writing conversations; stdlib-images: half of them
                                # asked with the function's start drawn in an image (needs target.embedded.vision)
    system_prompt: str | None = None  # a system turn put first where a conversation has none
    chat_template_kwargs: dict = field(default_factory=dict)  # to the chat template (enable_thinking), as served
    max_length: int = 2048  # tokens per sample
    overflow: str = "truncate"  # a longer sample: truncate it, or drop it
    bad_lines: str = "skip"  # a malformed line: skip and count it, or fail naming it
    heldout_fraction: float = 0.1  # share of conversations kept out of training (validation prompts)
    max_conversations: int | None = None  # at most this many training conversations (a seeded sample)
    regen: RegenConfig = field(default_factory=RegenConfig)  # regeneration of assistant turns by the target


@dataclass
class CaptureConfig:
    """Which hidden states to store, and how."""
    mode: str = "offline"  # offline: a store of features; online: the trainer runs the target
    layer_ids: list[int] | None = None  # input-to-layer ids of the features (None: the kind's default, e.g. [2, N//2, N-3])
    dtype: str = "bf16"  # dtype of stored features
    shard_size_mb: float = 256.0  # size of one store shard
    batch_tokens: int = 8192  # tokens per target forward while capturing
    # store only what the target cannot rebuild cheaply: EAGLE-3's mid and high features; the low
    # feature and the teacher are recomputed at train time from the first layer_ids[0] and the last
    # N - layer_ids[-1] target layers (5 of N layers with the defaults)
    recompute: bool = True
    compression: str = "zstd"  # compression of the store's shards
    chunk_tokens: int | None = None     # run a sample longer than this through the target in chunks over its own cache
                                        # (a prefill in pieces: one chunk's activations at a time); None: whole


@dataclass
class LoraJointConfig:
    """Joint training of head and target (Medusa-2; MTP joint): LoRA adapters on the target (peft),
    self-distillation (KL to the target with adapters off), heads-only warmup first."""
    rank: int = 16  # LoRA rank
    alpha: float = 32.0  # LoRA alpha
    dropout: float = 0.0  # LoRA dropout
    # the target's modules that get adapters
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"])
    heads_only_steps: int | None = None  # stage 1 (heads only); None: a third of train's steps
    heads_coefficient: float = 0.2       # weight of the head loss next to the KL term in stage 2
    heads_ramp: str = "sine"             # constant | linear | sine ramp of that weight over stage 2
    heads_lr_multiplier: float = 4.0     # heads' learning rate = train.lr x this; adapters get train.lr
    kl_weight: float = 1.0  # weight of the KL term to the original target


@dataclass
class HeadConfig:
    """Which head and its objective. Keys a kind does not read are ignored by it (see README)."""
    kind: str = "eagle3"  # eagle3 | eagle2 | medusa | mtp | dflash | peagle
    draft_vocab_size: int | None = None  # eagle3, peagle: the draft vocabulary (None: 32000); dflash: None drafts over
                                        # the target's whole vocabulary (z-lab), a size below it over the most frequent
                                        # tokens, as speculators' DFlash (eagle2, mtp, medusa: always the whole one)
    ttt_steps: int | None = None        # unrolled training-time-test steps (peagle: depths trained, the draft tokens
                                        # of one forward); None: the kind's default (eagle3 7, peagle 8)
    loss_decay: float | None = None     # weight decay^i of step/head i; None: the kind's default (0.8; mtp: beta 0.6, normalised)
    intermediate_size: int | None = None  # the draft layer's MLP width (None: the target's)
    fc_bias: bool | None = None         # eagle2: bias of fc; None: as the target family's published heads
    layer: str | None = None            # eagle2: draft layer llama | target; None: the target's family where an
                                        # engine's EAGLE-1 class holds it (llama, mistral, qwen2), else llama
    feature_weight: float = 1.0         # eagle2: SmoothL1 feature regression weight (EAGLE: 1.0)
    token_weight: float = 0.1           # eagle2: soft cross-entropy weight (EAGLE: 0.1)
    input_noise: float = 0.0            # eagle2: uniform feature noise width, x 512/seq_len (EAGLE: 0.2)
    init_from: str | None = None        # start from a published/exported head of this kind
    lm_head_init: str = "random"        # eagle3, peagle: the draft lm_head starts random, or as the target's own rows
                                        # of the draft vocabulary (target); init_from, where set, wins
    objective: str = "soft_ce"          # the vocabulary loss: soft_ce (soft cross-entropy to the teacher), or the
                                        # acceptance-rate (LK) losses: lk_alpha (-log a), lk_lambda (λ·KL + (1-λ)(1-a))
    lk_scale: float = 1.0               # lk_lambda: λ = lk_scale · exp(-lk_rate · a), a detached (SpecForge 1, 1;
    lk_rate: float = 1.0                #   speculators 1, 3)
    fc_norm: bool = False               # eagle3 (EAGLE 3.1): one RMSNorm per captured feature before fc
    norm_output: bool = False           # eagle3 (EAGLE 3.1): the normed output feeds both lm_head and the next step
    num_heads: int = 4                  # medusa: K heads, head k predicts token t+2+k
    num_layers: int = 1                 # medusa: residual SiLU blocks per head; mtp: D modules; dflash, peagle: draft
                                        # layers (published P-EAGLE heads: 4)
    shared_lm_head: bool = False        # medusa: every head reads through the target's frozen lm_head
    lora: LoraJointConfig | None = None  # medusa: set for Medusa-2 (joint LoRA training, capture.mode online)
    block_size: int | None = None       # dflash: B, the block drafted in one forward (None: 16); draft tokens B - 1
    num_anchors: int = 512              # dflash: random anchors (blocks) per sequence per step
    loss_gamma: float | None = None     # dflash: slot weights exp(-(k-1)/gamma); None: 7 for B >= 16, else 4
    mask_token_id: int | None = None    # dflash, peagle: the mask token (None: the target's pad, else eos token; recorded)
    dpace_alpha: float | None = None    # dflash: D-PACE slot weights with this floor a instead of the decay (None: decay)
    sliding_window: int | None = None   # dflash: the context window of the draft's sliding_attention layers (their block
                                        # attention causal); set alone: every layer but the last slides (z-lab Qwen3.6)
    layer_types: list[str] | None = None  # dflash: per draft layer, full_attention | sliding_attention
    cod_ratio: float = 0.7              # peagle: COD sampling keeps int((n - d)·max(r^d, r_min)) chains at depth d
    cod_min_ratio: float = 0.2          #   (speculators r 0.7, r_min 0.2; SpecForge's Qwen3-8B recipe r 0.8)


@dataclass
class TrackingConfig:
    backend: str = "wandb"  # wandb (offline without a key) or none
    project: str = "draftsmith"  # W&B project
    run_name: str | None = None  # W&B run name (None: the recipe's name)
    tags: list[str] = field(default_factory=list)  # W&B tags


@dataclass
class TrainConfig:
    epochs: float = 1.0  # passes over the data (fractions allowed)
    max_steps: int | None = None  # stop after this many optimizer steps (None: epochs decide)
    batch_size: int = 1  # samples per step per process
    max_batch_tokens: int = 4096  # tokens per batch at most (longer batches are split)
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-4  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_ratio: float = 0.015  # share of steps warming the learning rate up, then cosine decay
    max_grad_norm: float = 0.5  # gradient clipping norm
    eval_every: int = 200  # steps between held-out evaluations
    save_every: int = 200  # steps between checkpoints (a killed run resumes from the last)
    keep_last: int = 2  # checkpoints kept
    log_every: int = 10  # steps between logged metrics
    seed: int = 0  # seed of the head's initialisation and the data order
    activation_checkpointing: bool = False  # recompute each unrolled TTT step in backward: long samples
    group_by_length: bool = False       # batches of samples of similar lengths (shuffled windows): less padding
    sequence_parallel: int = 1          # consecutive processes that split one sample's positions (eagle3, eagle2, mtp)
    corrupt_samples: str = "fail"   # a sample failing its checksum: stop naming it, or skip (mask) and count it
    tracking: TrackingConfig = field(default_factory=TrackingConfig)  # where metrics go (W&B on the main process)


@dataclass
class PromptSet:
    """One set of validation prompts, reported as its own domain."""
    path: str = ""                  # a JSONL of conversations or {"prompt": ...} lines, or builtin:humaneval|math|chat
    domain: str | None = None       # None: each record's "domain", else the builtin set's name, else the file's stem
    split: str = "test"             # of a builtin set (math and chat have train and test; humaneval test only)


@dataclass
class ValidateConfig:
    num_prompts: int = 16           # in all, shared evenly by the prompt sets
    max_new_tokens: int = 128  # tokens decoded per prompt
    depth: int = 6  # draft depth (a chain's length, a tree's depth)
    top_k: int = 8  # children per node when drafting a tree (1: a chain)
    num_nodes: int = 32  # tree nodes verified per round (root included)
    temperature: float = 0.0  # 0: greedy (exactness checked); > 0: also lossless sampled decoding
    top_p: float = 1.0  # nucleus sampling of the sampled run
    sample_top_k: int = 0  # top-k sampling of the sampled run (0: off)
    device: str = "auto"  # auto: CUDA when present, else CPU
    min_tau: float | None = None  # a head below this tau does not pass
    prompts: str | list[PromptSet] | None = None  # a JSONL (conversations or {"prompt": ...} lines, optional "domain"),
                                    # or several sets, each its own domain; None: the held-out data
    tree_choices: list[list[int]] | None = None  # medusa: a static choice list; None: built from measured accuracies
    num_calibration_prompts: int = 8             # medusa: held-out prompts (after the measured ones) for the tree
    typical_acceptance: bool = False             # medusa: also measure Medusa's lossy typical acceptance (reported, never pass/fail)
    posterior_threshold: float = 0.09  # medusa: typical acceptance's threshold
    posterior_alpha: float = 0.3  # medusa: typical acceptance's alpha


@dataclass
class ExportConfig:
    formats: list[str] | None = None  # None: every engine the head kind exports to
    dtype: str = "bf16"


@dataclass
class EmbeddedDraftConfig:
    """A small causal LM that `draftsmith target` trains next to the embedded target, on its corpus
    and with its tokenizer: the demo's draft-model baseline (economics.draft_model)."""
    hidden_size: int = 64  # the draft model's width
    intermediate_size: int = 176  # its MLP width
    num_hidden_layers: int = 2  # its decoder layers
    num_attention_heads: int = 2  # its attention heads
    num_key_value_heads: int = 1  # its KV heads
    seq_len: int = 128  # training sequence length
    batch_size: int = 16  # training sequences per step
    lr: float = 6e-3  # peak learning rate
    max_steps: int | None = 400  # training steps
    train_seconds: float = 900.0  # wall-clock cap of its training
    seed: int = 0  # seed


@dataclass
class EconomicsConfig:
    """`draftsmith economics`: batched decoding swept over batch size and K (speculative tokens per
    row, drafted as one chain), the head next to the baselines, and the cost of each."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])  # batch sizes swept
    num_speculative_tokens: list[int] | None = None  # the K values; None: 0 to validate.depth
    num_prompts: int = 16          # distinct prompts (validate.prompts or held-out), repeated to fill a batch
    max_new_tokens: int = 64  # tokens decoded per row
    gpu_hour_usd: float | None = None      # price of the serving hardware; None: no cost table (or --gpu-hour-usd)
    extra_usd_per_hour: float = 0.0        # extra hardware a drafter needs (applied to every speculative setting)
    memory_fraction: float = 0.8           # batch sizes whose KV cache would exceed this share of free memory are skipped
    baselines: list[str] = field(default_factory=lambda: ["ngram", "draft-model"])
    ngram_max: int = 3  # the n-gram baseline's longest match
    ngram_min: int = 1  # its shortest match
    draft_model: str | None = None         # a small HF causal LM sharing the target's tokenizer
    draft_model_embedded: EmbeddedDraftConfig | None = None  # the demo: `draftsmith target` builds it at draft_model
    compare: list[str] = field(default_factory=list)  # other heads for this target (checkpoint or export directories),
    #                                      swept with the recipe's head in the same batches, each named by its run
    repeats: int = 1                       # each cell measured this many times in turn; the fastest run counts


@dataclass
class Recipe:
    """Everything about *what* to train. How to launch lives in recipes/launch/."""
    name: str = ""  # names the run directory <out_dir>/<name>
    out_dir: str = "runs"  # where runs are written
    seed: int = 0  # seed of everything the recipe draws at random
    target: TargetConfig = field(default_factory=TargetConfig)  # the frozen target
    data: DataConfig = field(default_factory=DataConfig)  # conversations in, tokens and loss masks out
    capture: CaptureConfig = field(default_factory=CaptureConfig)  # hidden states to store
    head: HeadConfig = field(default_factory=HeadConfig)  # the head and its objective
    train: TrainConfig = field(default_factory=TrainConfig)  # the trainer
    validate: ValidateConfig = field(default_factory=ValidateConfig)  # validation in the bundled runtime
    export: ExportConfig = field(default_factory=ExportConfig)  # engine formats
    economics: EconomicsConfig = field(default_factory=EconomicsConfig)  # draftsmith economics
    source_path: str = ""

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.pop("source_path")
        return data

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections, so a stage is invalidated only by what it reads."""
        data = self.to_dict()
        data["target"].pop("parallel")  # how the target is laid out never changes what a stage makes
        chosen = {name: data[name] for name in sections}
        return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:16]


CHOICES = {
    "target.dtype": {"auto", "fp32", "bf16", "fp16"},
    "data.overflow": {"truncate", "drop"},
    "data.bad_lines": {"skip", "fail"},
    "data.sources.format": {"auto", "sharegpt", "openai", "text", "prompt", "alpaca"},
    "capture.mode": {"offline", "online"},
    "capture.dtype": {"bf16", "fp16", "fp32", "fp8"},
    "capture.compression": {"none", "zstd"},
    "train.tracking.backend": {"wandb", "none"},
    "train.corrupt_samples": {"fail", "skip"},
    "head.lora.heads_ramp": {"constant", "linear", "sine"},
    "head.objective": {"soft_ce", "lk_alpha", "lk_lambda"},
    "head.lm_head_init": {"random", "target"},
    "export.dtype": {"bf16", "fp16", "fp32"},
    "economics.baselines": {"ngram", "draft-model"},
}


def loads(text: str, overrides: list[str] = (), source: str = "<string>") -> Recipe:
    """Parse recipe YAML text plus dotted overrides into a validated Recipe."""
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(f"{source}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: expected a mapping at the top level")
    for override in overrides:
        apply_override(raw, override)
    try:
        recipe = build(Recipe, raw, "", CHOICES)
    except RecipeError as exc:
        raise RecipeError(f"{source}: {exc}") from None
    if not recipe.name:
        raise RecipeError(f"{source}: key 'name' is required (it names the run directory)")
    if not recipe.target.model and recipe.target.embedded is None:
        raise RecipeError(f"{source}: set target.model (a model directory, hub id or .gguf file) or target.embedded")
    if recipe.target.gguf_file is not None:
        if not recipe.target.gguf_file.lower().endswith(".gguf") or recipe.target.model.lower().endswith(".gguf"):
            raise RecipeError(f"{source}: target.gguf_file={recipe.target.gguf_file!r} with target.model="
                              f"{recipe.target.model!r}: expected a .gguf file name inside the directory or hub "
                              "repository that target.model names")
        recipe.target.model = f"{recipe.target.model.rstrip('/')}/{recipe.target.gguf_file}"
        recipe.target.gguf_file = None
    if recipe.data.builtin not in (None, "stdlib", "stdlib-images"):
        raise RecipeError(f"{source}: data.builtin={recipe.data.builtin!r}: expected 'stdlib' or 'stdlib-images'")
    if recipe.data.builtin == "stdlib-images" and (recipe.target.embedded is None or recipe.target.embedded.vision is None):
        raise RecipeError(f"{source}: data.builtin='stdlib-images' draws images the embedded image-text target reads: "
                          "set target.embedded.vision (recipes/demo/stdlib-vlm-eagle3.yaml)")
    regen = recipe.data.regen
    if regen.server is not None and not regen.server.startswith(("http://", "https://")):
        raise RecipeError(f"{source}: data.regen.server={regen.server!r}: expected an http(s) base URL such as "
                          "http://host:8000/v1")
    if regen.concurrency < 1 or regen.max_retries < 0 or regen.timeout_s <= 0:
        raise RecipeError(f"{source}: data.regen.concurrency={regen.concurrency}, max_retries={regen.max_retries}, "
                          f"timeout_s={regen.timeout_s}: expected concurrency >= 1, retries >= 0, a positive timeout")
    par = recipe.target.parallel
    if min(par.tp, par.pp, par.ep) < 1 or par.ep not in (1, par.tp):
        raise RecipeError(f"{source}: target.parallel tp={par.tp} pp={par.pp} ep={par.ep}: expected sizes >= 1 and "
                          "ep either 1 or equal to tp (experts are split over the ranks of one tensor-parallel group)")
    if recipe.capture.chunk_tokens is not None and recipe.capture.chunk_tokens < 1:
        raise RecipeError(f"{source}: capture.chunk_tokens={recipe.capture.chunk_tokens}: expected a positive number of "
                          "positions per chunk, or null to run each sample whole")
    head = recipe.head
    if not (0 < head.cod_min_ratio <= head.cod_ratio <= 1):
        raise RecipeError(f"{source}: head.cod_ratio={head.cod_ratio}, head.cod_min_ratio={head.cod_min_ratio}: expected "
                          "0 < cod_min_ratio <= cod_ratio <= 1")
    econ = recipe.economics
    if econ.draft_model_embedded is not None and (recipe.target.embedded is None or not econ.draft_model):
        raise RecipeError(f"{source}: economics.draft_model_embedded needs target.embedded (it shares the embedded "
                          "target's tokenizer and corpus) and economics.draft_model (where to build it)")
    if not econ.batch_sizes or min(econ.batch_sizes) < 1:
        raise RecipeError(f"{source}: economics.batch_sizes={econ.batch_sizes}: expected batch sizes >= 1")
    if econ.num_speculative_tokens is not None and (not econ.num_speculative_tokens or min(econ.num_speculative_tokens) < 0):
        raise RecipeError(f"{source}: economics.num_speculative_tokens={econ.num_speculative_tokens}: expected K values >= 0")
    if econ.repeats < 1:
        raise RecipeError(f"{source}: economics.repeats={econ.repeats}: expected how many times to measure each cell (>= 1)")
    recipe.source_path = source
    return recipe


def load(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """Load a recipe YAML file; see `loads`."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} does not exist")
    return loads(path.read_text(), overrides, source=str(path))


def dump(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)
