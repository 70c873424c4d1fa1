"""How far a jointly fine-tuned target (Medusa-2, joint MTP) drifted from the original, on the
same held-out prompts: teacher-forced top-1 agreement (on the original's greedy continuation, the
share of positions where both models' argmax agree: one flipped token does not spoil the rest), the
position of the first divergence of the free-running greedy outputs, positional greedy agreement
(tokens and whole outputs), mean KL(original || fine-tuned) per generated token, and perplexity of
both on assistant tokens of held-out (or `validate.prompts`) conversations with answers; null when
there are none, never a made-up 1.0. The adapter stays
unmerged while measuring (`disable_adapter()` gives the original: one copy in memory), and is then
merged: the returned model is the one Medusa-2 serves. Decoding here is Hugging Face `generate`,
independent of draftsmith's runtime."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from draftsmith.recipe import Recipe

MAX_PERPLEXITY_CONVERSATIONS = 32


def _greedy(model, prompt_T: torch.Tensor, max_new_tokens: int, eos: set[int]) -> list[int]:
    ids = prompt_T[None]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=sorted(eos) or None, pad_token_id=0)
    return out[0, len(prompt_T):].tolist()


def _logprobs(model, ids_T: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model(input_ids=ids_T[None]).logits[0].float(), dim=-1)


def _token_agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    longest = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)), longest


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first generated token where the two outputs differ; None when identical."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _perplexity(model, conversations: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
    if not conversations:
        return None
    nll, count = 0.0, 0
    for ids, mask in conversations:
        logp = _logprobs(model, ids)[:-1]
        picked = logp.gather(-1, ids[1:, None]).squeeze(-1)
        keep = mask[1:].bool()
        nll -= float(picked[keep].sum())
        count += int(keep.sum())
    return math.exp(nll / max(count, 1))


def _prompt_file_conversations(path: str) -> list[dict]:
    """`validate.prompts` lines that are whole conversations (with answers); prompts have none."""
    from draftsmith.data.conversations import DataError, normalize
    out = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        record = json.loads(line) if line.strip() else None
        try:
            conv = normalize(record, f"{path}:{number}") if isinstance(record, dict) else {}
        except DataError:
            continue
        if any(m["role"] == "assistant" for m in conv.get("messages", [])):
            out.append(conv)
    return out


def heldout_conversations(recipe: Recipe, tokenizer, device, limit: int = MAX_PERPLEXITY_CONVERSATIONS):
    """Conversations with assistant tokens to measure perplexity on: `validate.prompts` when it is set
    (those of its lines that carry answers), else the held-out split."""
    from draftsmith.data.conversations import encode_conversation
    from draftsmith.data.prepare import load_heldout
    from draftsmith.data.prompt_sets import is_builtin
    from draftsmith.runtime.loading import prompt_sets
    files = [s.path for s in prompt_sets(recipe) if not is_builtin(s.path)]
    source = [c for path in files for c in _prompt_file_conversations(path)] if recipe.validate.prompts else load_heldout(recipe)
    out = []
    for conv in [c for c in source if "messages" in c][:limit]:
        ids, mask = encode_conversation(tokenizer, conv, recipe.data.system_prompt)
        if sum(mask):
            out.append((torch.tensor(ids[:recipe.data.max_length], device=device),
                        torch.tensor(mask[:recipe.data.max_length], device=device)))
    return out


@torch.no_grad()
def measure_drift(recipe: Recipe, model, adapter_dir: Path, prompts: list[torch.Tensor], eos: set[int], tokenizer) -> tuple[object, dict]:
    """(the fine-tuned target, adapter merged; the drift report)."""
    from peft import PeftModel
    if not (Path(adapter_dir) / "adapter_config.json").exists():
        raise ValueError(f"{adapter_dir}: a head trained jointly with its target needs its LoRA adapter (adapter_config.json)")
    tuned = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    new_tokens = recipe.validate.max_new_tokens
    same_tokens = total_tokens = same_outputs = forced_same = forced_total = 0
    kl_sum, kl_count, divergence = 0.0, 0, []
    for prompt in prompts:
        with tuned.disable_adapter():
            original = _greedy(tuned, prompt, new_tokens, eos)
        finetuned = _greedy(tuned, prompt, new_tokens, eos)
        same, longest = _token_agreement(original, finetuned)
        same_tokens, total_tokens, same_outputs = same_tokens + same, total_tokens + longest, same_outputs + (original == finetuned)
        divergence.append(_first_divergence(original, finetuned))
        forced = torch.cat([prompt, torch.tensor(original, device=prompt.device, dtype=prompt.dtype)])
        with tuned.disable_adapter():   # teacher-forced on the original's own greedy continuation
            original_top1 = _logprobs(tuned, forced)[len(prompt) - 1:-1].argmax(-1)
        tuned_top1 = _logprobs(tuned, forced)[len(prompt) - 1:-1].argmax(-1)
        forced_same, forced_total = forced_same + int((original_top1 == tuned_top1).sum()), forced_total + len(original)
        seq = torch.cat([prompt, torch.tensor(finetuned, device=prompt.device, dtype=prompt.dtype)])
        logq = _logprobs(tuned, seq)[len(prompt) - 1:-1]
        with tuned.disable_adapter():
            logp = _logprobs(tuned, seq)[len(prompt) - 1:-1]
        kl_sum += float((logp.exp() * (logp - logq)).sum())
        kl_count += len(logp)
    conversations = heldout_conversations(recipe, tokenizer, prompts[0].device)
    with tuned.disable_adapter():
        ppl_original = _perplexity(tuned, conversations)
    ppl_tuned = _perplexity(tuned, conversations)
    report = {"num_prompts": len(prompts), "teacher_forced_top1_agreement": forced_same / max(forced_total, 1),
              "first_divergence_per_prompt": divergence,
              "greedy_token_agreement": same_tokens / max(total_tokens, 1),
              "greedy_output_agreement": same_outputs / max(len(prompts), 1), "mean_kl_per_token": kl_sum / max(kl_count, 1),
              "perplexity_original": ppl_original, "perplexity_finetuned": ppl_tuned,
              "num_perplexity_conversations": len(conversations),
              "perplexity_source": ("not measured: no conversation with answers" if not conversations else
                                    "validate.prompts" if recipe.validate.prompts else "held-out split"),
              "note": "joint training (Medusa-2, joint MTP) fine-tunes the target: the served model is the merged "
                      "fine-tuned target, not the original"}
    return tuned.merge_and_unload(), report
