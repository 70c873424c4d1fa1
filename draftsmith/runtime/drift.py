"""How far a jointly fine-tuned target (Medusa-2, joint MTP) drifted from the original, on the
same held-out prompts: greedy agreement (tokens and whole outputs), mean KL(original || fine-tuned)
per generated token, and held-out perplexity of both on assistant tokens. The adapter stays
unmerged while measuring (`disable_adapter()` gives the original: one copy in memory), and is then
merged: the returned model is the one Medusa-2 serves. Decoding here is Hugging Face `generate`,
independent of draftsmith's runtime."""
from __future__ import annotations

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


def _perplexity(model, conversations: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    nll, count = 0.0, 0
    for ids, mask in conversations:
        logp = _logprobs(model, ids)[:-1]
        picked = logp.gather(-1, ids[1:, None]).squeeze(-1)
        keep = mask[1:].bool()
        nll -= float(picked[keep].sum())
        count += int(keep.sum())
    return math.exp(nll / max(count, 1))


def heldout_conversations(recipe: Recipe, tokenizer, device, limit: int = MAX_PERPLEXITY_CONVERSATIONS):
    from draftsmith.data.conversations import encode_conversation
    from draftsmith.data.prepare import load_heldout
    out = []
    for conv in load_heldout(recipe)[:limit]:
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
    same_tokens = total_tokens = same_outputs = 0
    kl_sum, kl_count = 0.0, 0
    for prompt in prompts:
        with tuned.disable_adapter():
            original = _greedy(tuned, prompt, new_tokens, eos)
        finetuned = _greedy(tuned, prompt, new_tokens, eos)
        same, longest = _token_agreement(original, finetuned)
        same_tokens, total_tokens, same_outputs = same_tokens + same, total_tokens + longest, same_outputs + (original == finetuned)
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
    report = {"num_prompts": len(prompts), "greedy_token_agreement": same_tokens / max(total_tokens, 1),
              "greedy_output_agreement": same_outputs / max(len(prompts), 1), "mean_kl_per_token": kl_sum / max(kl_count, 1),
              "perplexity_original": ppl_original, "perplexity_finetuned": ppl_tuned,
              "num_perplexity_conversations": len(conversations),
              "note": "joint training (Medusa-2, joint MTP) fine-tunes the target: the served model is the merged "
                      "fine-tuned target, not the original"}
    return tuned.merge_and_unload(), report
