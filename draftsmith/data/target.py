"""The target model: loading any Hugging Face causal LM, and building the embedded default
(a tiny Llama plus byte-level BPE tokenizer trained on CPU on the stdlib's source)."""
from __future__ import annotations

import hashlib
import math
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith import artifacts
from draftsmith.data import stdlib
from draftsmith.recipe import EmbeddedTargetConfig, Recipe

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BUILDER_VERSION = 2  # bump when the embedded target's corpus or training changes: cached targets rebuild


def embedded_inputs_hash(recipe: Recipe) -> str:
    return f"{recipe.section_hash('target')}-v{BUILDER_VERSION}"


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on CUDA (speed) and fp32 on CPU (exactness)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def target_fingerprint(model: str) -> str:
    """Cheap identity of a model directory: its config plus, per weight file, the size and a hash of
    sampled 64 KiB blocks (so a retrained target differs, without reading 100 GB of weights)."""
    path = Path(model)
    if not path.is_dir():
        return hashlib.sha256(model.encode()).hexdigest()[:16]
    digest = hashlib.sha256((path / "config.json").read_bytes() if (path / "config.json").exists() else b"")
    for weight in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        size = weight.stat().st_size
        digest.update(f"{weight.name}:{size}".encode())
        with open(weight, "rb") as handle:
            for k in range(16):
                handle.seek(size * k // 16)
                digest.update(handle.read(1 << 16))
    return digest.hexdigest()[:16]


def check_model_path(model: str, key: str = "target.model") -> None:
    looks_local = model.startswith((".", "/", "runs")) or Path(model).exists()
    if looks_local and not (Path(model) / "config.json").exists():
        raise ValueError(f"{key}={model!r}: no model directory with a config.json there "
                         f"(for the embedded default run `draftsmith target --recipe ...` first)")


def load_tokenizer(recipe: Recipe):
    from transformers import AutoTokenizer
    check_model_path(recipe.target.model)
    tokenizer = AutoTokenizer.from_pretrained(recipe.target.model)
    if recipe.target.chat_template:
        tokenizer.chat_template = recipe.target.chat_template
    tokenizer.draftsmith_template_kwargs = dict(recipe.data.chat_template_kwargs)
    return tokenizer


def load_target(recipe: Recipe, device: torch.device | None = None):
    """Any AutoModelForCausalLM, frozen, in eval mode, SDPA attention."""
    from transformers import AutoModelForCausalLM
    check_model_path(recipe.target.model)
    device = device or pick_device()
    model = AutoModelForCausalLM.from_pretrained(
        recipe.target.model, dtype=resolve_dtype(recipe.target.dtype, device), attn_implementation="sdpa")
    model.requires_grad_(False)
    return model.eval().to(device)


# ---------------------------------------------------------------- the embedded default

def _corpus(cfg: EmbeddedTargetConfig, heldout_fraction: float) -> tuple[list, list]:
    """Function sources and chat-form conversations (the demo's domain), split by module into
    train and held-out; `chat_fraction` of the documents are conversations."""
    rng = random.Random(cfg.seed)
    train, heldout, size = [], [], 0
    modules = stdlib.list_modules()
    rng.shuffle(modules)
    for module in modules:
        held = stdlib.is_heldout(module.name, heldout_fraction)
        if not held and size > cfg.corpus_mb * 1e6:
            continue
        target = heldout if held else train
        for body in stdlib.function_sources(module):
            target.append(body)
            size += len(body) * (not held)
        for conv in stdlib.function_conversations(module):
            if rng.random() < cfg.chat_fraction:
                target.append(conv)
    rng.shuffle(train)
    return train, heldout


def _train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>", pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:], chat_template=DEMO_CHAT_TEMPLATE,
        model_max_length=1 << 20)


def _encode_stream(tokenizer, items: list) -> torch.Tensor:
    ids = []
    for item in items:
        if isinstance(item, dict):
            ids += tokenizer.apply_chat_template(item["messages"], tokenize=True, return_dict=False)
        else:
            ids += [tokenizer.bos_token_id] + tokenizer(item, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def _heldout_loss(model, stream: torch.Tensor, seq_len: int, num_windows: int = 24) -> float:
    gen = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, len(stream) - seq_len - 1, (num_windows,), generator=gen)
    batch = torch.stack([stream[s:s + seq_len] for s in starts.tolist()])
    with torch.no_grad():
        return model(input_ids=batch, labels=batch).loss.item()


def build_embedded_target(recipe: Recipe, out_dir: str | Path, heldout_fraction: float = 0.1) -> dict:
    """Train the tiny Llama on stdlib source for a time budget; save like any hub model."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = recipe.target.embedded
    torch.manual_seed(cfg.seed)
    train_items, heldout_items = _corpus(cfg, heldout_fraction)
    tokenizer = _train_tokenizer([t if isinstance(t, str) else t["messages"][0]["content"] for t in train_items],
                                 cfg.vocab_size)
    train_stream = _encode_stream(tokenizer, train_items)
    heldout_stream = _encode_stream(tokenizer, [t for t in heldout_items if isinstance(t, str)])
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, rope_theta=10000.0)
    model = LlamaForCausalLM(config)
    steps, seconds = _train_lm(model, train_stream, cfg)
    model.eval()
    loss = _heldout_loss(model, heldout_stream, cfg.seq_len)
    out_dir = Path(out_dir)
    with artifacts.atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            import shutil
            shutil.rmtree(out_dir)
    sample = greedy_sample(model, tokenizer, heldout_items)
    report = {"target_id": str(out_dir), "fingerprint": target_fingerprint(str(out_dir)),
              "num_parameters": sum(p.numel() for p in model.parameters()), "train_steps": steps,
              "train_seconds": round(seconds, 1), "train_tokens": steps * cfg.batch_size * cfg.seq_len,
              "heldout_loss": round(loss, 4), "heldout_perplexity": round(math.exp(loss), 3),
              "sample_prompt": sample[0], "sample_continuation": sample[1]}
    artifacts.write_manifest(out_dir, "target", embedded_inputs_hash(recipe), **report)
    return report


def _train_lm(model, stream: torch.Tensor, cfg: EmbeddedTargetConfig) -> tuple[int, float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed)
    start, step = time.perf_counter(), 0
    bar = tqdm(total=int(cfg.train_seconds), desc="target", unit="s", mininterval=2.0, bar_format="{l_bar}{bar}| {n}/{total}s {postfix}")
    model.train()
    max_steps = cfg.max_steps or 10**9
    while step < max_steps and (elapsed := time.perf_counter() - start) < cfg.train_seconds:
        # cosine decay over the step budget when there is one (reproducible), else over the time budget
        progress = step / cfg.max_steps if cfg.max_steps else elapsed / cfg.train_seconds
        lr = cfg.lr * (min(1.0, (step + 1) / 50)) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        for group in optimizer.param_groups:
            group["lr"] = max(lr, cfg.lr * 0.05)
        starts = torch.randint(0, len(stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
        batch = torch.stack([stream[s:s + cfg.seq_len] for s in starts.tolist()])
        with torch.autocast(device_type=pick_device().type, dtype=torch.bfloat16):  # 2-3x on CPUs with bf16 units
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        bar.set_postfix(step=step, loss=f"{loss.item():.3f}", refresh=False)
        bar.update(max(0, min(int(elapsed), bar.total) - bar.n))
    bar.close()
    return step, time.perf_counter() - start


def greedy_sample(model, tokenizer, heldout_items: list, new_tokens: int = 96) -> tuple[str, str]:
    """The target's greedy answer to a held-out chat prompt, to eyeball that it writes Python."""
    conv = next(t for t in heldout_items if isinstance(t, dict))
    ids = tokenizer.apply_chat_template(conv["messages"][:1], add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return conv["messages"][0]["content"], tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def _empty_target(model_dir: str):
    """(config, the architecture with parameters on the meta device and buffers such as rotary
    tables real): parameter names and module layout without reading any weight."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    check_model_path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return config, model


def _weight_name(model, module) -> str:
    return next(f"{name}.weight" for name, m in model.named_modules() if m is module)


def _read_weights(model_dir: str, names: set[str], why: str, optional: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The named tensors from the model's safetensors files, nothing else; a missing one is an error
    (except `optional` ones, e.g. a tied lm_head)."""
    from safetensors import safe_open
    found = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in names.intersection(handle.keys()):
                found[name] = handle.get_tensor(name)
    missing = sorted(names - set(found) - set(optional))
    if missing:
        raise ValueError(f"{model_dir}: weight files lack {missing[:4]}{' ...' if len(missing) > 4 else ''} ({why})")
    return found


def _tied(config) -> bool:
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def load_target_embeddings(model_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding, lm_head) weights alone, read from the weight files without loading the model.
    Names come from the architecture itself, so this works for any causal LM with safetensors
    weights; a tied head returns the embedding twice."""
    config, model = _empty_target(model_dir)
    embed, head = _weight_name(model, model.get_input_embeddings()), _weight_name(model, model.get_output_embeddings())
    found = _read_weights(model_dir, {embed, head}, "needed for the head's embedding and teacher",
                          optional={head} if _tied(config) else set())
    return found[embed], found.get(head, found[embed])


def load_target_layers(recipe: Recipe, device: torch.device, skip: range):
    """The target with decoder layers `skip` never loaded (pass-through stand-ins), frozen: what the
    trainer needs to rebuild the features a compact capture store leaves out. Only the kept weights
    are read from the safetensors files, so a 70B target costs a few layers of memory."""
    from draftsmith.data.capture import Skip
    config, model = _empty_target(recipe.target.model)
    layers = model.get_decoder().layers
    for i in skip:
        layers[i] = Skip()
    head = _weight_name(model, model.get_output_embeddings())
    wanted = {name for name, _ in model.named_parameters(remove_duplicate=False)} - ({head} if _tied(config) else set())
    state = _read_weights(recipe.target.model, wanted, "needed to rebuild features at train time; "
                          "capture with capture.recompute: false instead")
    dtype = resolve_dtype(recipe.target.dtype, device)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if _tied(config):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    model.requires_grad_(False)
    return model.eval().to(device)
