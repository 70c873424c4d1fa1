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
from draftsmith.targets import code_images, stdlib
from draftsmith.targets.loading import target_fingerprint

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
DEMO_CHAT_TEMPLATE = (  # a content may be a list of parts: an image part renders the processor's placeholder
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|end|>\n' }}"
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


def _train_tokenizer(texts: list[str], vocab_size: int, image_token: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    specials = SPECIAL_TOKENS + [code_images.IMAGE_TOKEN] * image_token
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>", pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:], chat_template=DEMO_CHAT_TEMPLATE, model_max_length=1 << 20,
        **({"extra_special_tokens": {"image_token": code_images.IMAGE_TOKEN}} if image_token else {}))


def _model(cfg: EmbeddedTargetConfig, tokenizer):
    """(model, processor): the tiny Llama; with `cfg.vision`, a LLaVA model (CLIP tower, projector, the same Llama)
    and its processor, one image token a patch."""
    from transformers import LlamaConfig, LlamaForCausalLM
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, rope_theta=10000.0)
    if cfg.vision is None:
        return LlamaForCausalLM(text), None
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaImageProcessorPil, LlavaProcessor
    vision, size = cfg.vision, code_images.image_size(cfg.vision)
    processor = LlavaProcessor(
        image_processor=LlavaImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size}),
        tokenizer=tokenizer, chat_template=DEMO_CHAT_TEMPLATE, patch_size=vision.patch_size,
        vision_feature_select_strategy="default", num_additional_image_tokens=1)  # CLIP's class token, dropped
    config = LlavaConfig(
        text_config=text, image_token_index=tokenizer.image_token_id, vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        vision_config=CLIPVisionConfig(hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
                                       num_hidden_layers=vision.num_hidden_layers, num_attention_heads=vision.num_attention_heads,
                                       image_size=size, patch_size=vision.patch_size, projection_dim=vision.hidden_size))
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    return model, processor


def _image_batches(processor, conversations: list[dict], cfg: EmbeddedTargetConfig):
    """A sampler of training batches of image conversations: the function's start drawn, its source the answer
    (under the loss: the answer and the text turns, never the image tokens or padding). `cells` holds the token
    drawn in each patch (-100: an empty one), for the reading loss."""
    tokenizer = processor.tokenizer
    asked = [{"type": "image"}, {"type": "text", "text": code_images.IMAGE_PROMPT}]

    def sample(gen: torch.Generator) -> dict:
        picks = [conversations[i] for i in torch.randint(0, len(conversations), (cfg.batch_size,), generator=gen).tolist()]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": asked}, *c["messages"][1:]], tokenize=False)
                 for c in picks]
        images = [code_images.render(code_images.drawn_text(c), cfg.vision, tokenizer) for c in picks]
        batch = processor(text=texts, images=images, padding=True, add_special_tokens=False, return_tensors="pt")
        ids, attention = batch["input_ids"][:, :cfg.seq_len], batch["attention_mask"][:, :cfg.seq_len]
        labels = ids.masked_fill((attention == 0) | (ids == tokenizer.image_token_id), -100)
        cells = torch.tensor([[-100 if t is None else t for t in code_images.layout(code_images.drawn_text(c), cfg.vision, tokenizer)]
                              for c in picks])
        return {"input_ids": ids, "attention_mask": attention, "pixel_values": batch["pixel_values"], "labels": labels,
                "cells": cells}
    return sample


def _reading_loss(model, pixel_values: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """Each patch's image feature, scored against the language model's input embeddings, should pick the token drawn
    in it: the tower is taught to read beside the language-model loss. Without it the tower's
    features drift to the same for every image (the language model learns early to do without them)."""
    features = model.get_image_features(pixel_values=pixel_values)
    features = getattr(features, "pooler_output", features)
    features = torch.cat(list(features)) if isinstance(features, (list, tuple)) else features.reshape(-1, features.shape[-1])
    logits = features @ model.get_input_embeddings().weight.T
    return torch.nn.functional.cross_entropy(logits.float(), cells.reshape(-1), ignore_index=-100)


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
    cfg = recipe.target.embedded
    torch.manual_seed(cfg.seed)
    train_items, heldout_items = _corpus(cfg, heldout_fraction)
    tokenizer = _train_tokenizer([t if isinstance(t, str) else t["messages"][0]["content"] for t in train_items],
                                 cfg.vocab_size, image_token=cfg.vision is not None)
    train_stream = _encode_stream(tokenizer, train_items)
    heldout_stream = _encode_stream(tokenizer, [t for t in heldout_items if isinstance(t, str)])
    model, processor = _model(cfg, tokenizer)
    image_batch = None
    if processor is not None:  # the image conversations: every chat-form function of the training modules
        image_batch = _image_batches(processor, [t for t in train_items if isinstance(t, dict)], cfg)
    steps, seconds = _train_lm(model, train_stream, cfg, image_batch=image_batch)
    model.eval()
    loss = _heldout_loss(model, heldout_stream, cfg.seq_len)
    out_dir = Path(out_dir)
    with artifacts.atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp)
        (processor or tokenizer).save_pretrained(tmp)
        if out_dir.exists():
            import shutil
            shutil.rmtree(out_dir)
    sample = greedy_sample(model, tokenizer, heldout_items)
    report = {"target_id": str(out_dir), "fingerprint": target_fingerprint(str(out_dir)),
              "num_parameters": sum(p.numel() for p in model.parameters()), "train_steps": steps,
              "train_seconds": round(seconds, 1), "train_tokens": steps * cfg.batch_size * cfg.seq_len,
              "heldout_loss": round(loss, 4), "heldout_perplexity": round(math.exp(loss), 3),
              "sample_prompt": sample[0], "sample_continuation": sample[1]}
    if processor is not None:
        report["image_reading"] = image_reading(model, processor, [t for t in heldout_items if isinstance(t, dict)], cfg)
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


def _train_lm(model, stream: torch.Tensor, cfg, desc: str = "target", image_batch=None) -> tuple[int, float]:
    """Windows of the token stream; with `image_batch`, that share (`cfg.vision.image_fraction`) of the steps
    trains on a batch of image conversations instead."""
    # the vision tower and projector (an image-text target) at their own, lower rate: at the language model's, Adam's
    # steps on their weak early gradients drift them into features that are the same for every image
    seeing = [p for n, p in model.named_parameters() if "vision_tower" in n or "multi_modal_projector" in n]
    rest = [p for n, p in model.named_parameters() if not ("vision_tower" in n or "multi_modal_projector" in n)]
    scale = cfg.vision.lr / cfg.lr if seeing else 1.0
    optimizer = torch.optim.AdamW([{"params": rest, "scale": 1.0}] + ([{"params": seeing, "scale": scale}] if seeing else []),
                                  lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
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
            group["lr"] = max(lr, cfg.lr * 0.05) * group["scale"]
        if image_batch is not None and torch.rand((), generator=gen).item() < cfg.vision.image_fraction:
            batch = image_batch(gen)
        else:
            starts = torch.randint(0, len(stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
            windows = torch.stack([stream[s:s + cfg.seq_len] for s in starts.tolist()])
            batch = {"input_ids": windows, "labels": windows}
        # fp32 on the CPU: CPUs without bf16 units emulate bf16 autocast ~12x slower, and fp32 keeps a
        # step-budgeted target the same on every machine
        cells = batch.pop("cells", None)
        loss = model(**batch).loss
        if cells is not None:
            loss = loss + _reading_loss(model, batch["pixel_values"], cells)
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


@torch.no_grad()
def image_reading(model, processor, conversations: list[dict], cfg: EmbeddedTargetConfig, num: int = 32) -> dict:
    """How well the image-text target reads: on held-out functions asked with an image, the share of the drawn
    characters its greedy answer's first line gives back in place (the signature it transcribes), and the share of
    answers whose first line is the drawn signature exactly, and the share of distinct first lines (a target that
    ignores its images gives one answer to all)."""
    tokenizer, asked = processor.tokenizer, [{"type": "image"}, {"type": "text", "text": code_images.IMAGE_PROMPT}]
    picks = conversations[:num]
    drawn = [code_images.drawn_text(c) for c in picks]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": asked}], tokenize=False, add_generation_prompt=True)
    # one batch: the prompts differ only in their image, so they are all the same length (no padding)
    inputs = processor(text=[prompt] * len(picks), images=[code_images.render(d, cfg.vision, tokenizer) for d in drawn],
                       add_special_tokens=False, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    chars = exact = total = 0
    lines = set()
    for row, text in zip(out[:, inputs["input_ids"].shape[1]:], drawn):
        line = tokenizer.decode(row, skip_special_tokens=True).split("\n")[0].strip()
        # the drawn signature as far as the image holds it (grid x grid characters, rows broken at the grid's width)
        visible = text.split("\n")[0][:cfg.vision.grid * cfg.vision.grid]
        chars += sum(a == b for a, b in zip(line, visible))
        total += len(visible)
        exact += line.startswith(visible)
        lines.add(line)
    return {"prompts": len(picks), "char_accuracy": round(chars / max(total, 1), 3),
            "first_line_exact": round(exact / max(len(picks), 1), 3), "distinct_first_lines": round(len(lines) / max(len(picks), 1), 3)}
