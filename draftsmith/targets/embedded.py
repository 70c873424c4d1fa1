"""The embedded default target: a tiny Llama plus a byte-level BPE tokenizer, trained on CPU on the
Python standard library's function source (raw and in chat form), saved like any hub model."""
from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith import artifacts
from draftsmith.recipe import EmbeddedTargetConfig, Recipe
from draftsmith.targets import stdlib
from draftsmith.targets.loading import target_fingerprint

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
BUILDER_VERSION = 3  # bump when the embedded target's corpus or training changes: cached targets rebuild


def embedded_inputs_hash(recipe: Recipe) -> str:
    return f"{recipe.section_hash('target')}-v{BUILDER_VERSION}"


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


def draft_inputs_hash(recipe: Recipe) -> str:
    """The embedded draft model's inputs: its own shape and budget, and the target it drafts for."""
    import hashlib
    import json
    from dataclasses import asdict
    text = json.dumps(asdict(recipe.economics.draft_model_embedded), sort_keys=True) + embedded_inputs_hash(recipe)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ensure_draft_model(recipe: Recipe) -> dict | str:
    """The embedded draft model (economics.draft_model_embedded), built when missing or stale. It is
    no input of data/capture/train, so `draftsmith run` leaves it alone; `target` and `economics` build it."""
    if artifacts.stage_is_current(recipe.economics.draft_model, "draft-model", draft_inputs_hash(recipe)):
        return f"{recipe.economics.draft_model}: up to date"
    return build_embedded_draft(recipe)


def build_embedded_draft(recipe: Recipe) -> dict:
    """A small Llama with the embedded target's tokenizer, trained on the target's corpus (the
    draft-model baseline of `draftsmith economics`), saved at economics.draft_model."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    cfg, out_dir = recipe.economics.draft_model_embedded, Path(recipe.economics.draft_model)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(recipe.target.model)
    train_items, heldout_items = _corpus(recipe.target.embedded, recipe.data.heldout_fraction)
    stream = _encode_stream(tokenizer, train_items)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=recipe.target.embedded.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, rope_theta=10000.0)
    model = LlamaForCausalLM(config)
    steps, seconds = _train_lm(model, stream, cfg, desc="draft model")
    model.eval()
    loss = _heldout_loss(model, _encode_stream(tokenizer, [t for t in heldout_items if isinstance(t, str)]), cfg.seq_len)
    with artifacts.atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            import shutil
            shutil.rmtree(out_dir)
    report = {"draft_model": str(out_dir), "target_id": recipe.target.model, "num_parameters": sum(p.numel() for p in model.parameters()),
              "train_steps": steps, "train_seconds": round(seconds, 1), "heldout_loss": round(loss, 4),
              "heldout_perplexity": round(math.exp(loss), 3)}
    artifacts.write_manifest(out_dir, "draft-model", draft_inputs_hash(recipe), **report)
    return report


def train_on_corpus(model, tokenizer, cfg, desc: str = "target") -> tuple[int, float]:
    """Train any causal LM on the embedded corpus (the stdlib's source, `cfg`'s budget): (steps, seconds)."""
    train_items, _ = _corpus(cfg, 0.1)
    return _train_lm(model, _encode_stream(tokenizer, train_items), cfg, desc)


def _train_lm(model, stream: torch.Tensor, cfg, desc: str = "target") -> tuple[int, float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed)
    start, step = time.perf_counter(), 0
    bar = tqdm(total=int(cfg.train_seconds), desc=desc, unit="s", mininterval=2.0, bar_format="{l_bar}{bar}| {n}/{total}s {postfix}")
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
        # fp32 on the CPU: CPUs without bf16 units emulate bf16 autocast ~12x slower, and fp32 keeps a
        # step-budgeted target the same on every machine
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
