"""Load an exported head (any engine's layout, as `draftsmith export` writes it or as published) next to its
target, decode a prompt speculatively, and check the output against the target's own `generate`.

    python examples/decode_with_export.py EXPORT_DIR TARGET ["a prompt"] [--depth K]"""
import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.heads.drafting import TreeConfig
from draftsmith.heads.loading import load_head
from draftsmith.heads.registry import head_spec
from draftsmith.runtime.compile import step_compiler
from draftsmith.runtime.generate import speculative_generate
from draftsmith.runtime.target import TargetRunner
from draftsmith.runtime.verify import SamplingConfig
from draftsmith.targets.loading import local_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export_dir")
    parser.add_argument("target", help="model directory, hub id or .gguf file")
    parser.add_argument("prompt", nargs="?", default="Write a Python function that reverses a string.")
    parser.add_argument("--depth", type=int, default=3, help="speculative tokens per round (a chain)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    source = local_model(args.target, "auto")  # a GGUF file becomes a model directory once
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    head, meta = load_head(args.export_dir, model.config, model.get_input_embeddings().weight,
                           model.get_output_embeddings().weight)
    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True)
    prompt = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    max_len = len(prompt) + args.max_new_tokens + 2 * args.depth + 8
    runner = TargetRunner(model, max_len, head.config.get("draftsmith", {}).get("layer_ids", []))
    drafter = head_spec(head.kind).drafter(head, max_len, TreeConfig(args.depth, 1, args.depth + 1, None),
                                      step_compiler("auto", model.device))
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    out = speculative_generate(runner, drafter, prompt, args.max_new_tokens, SamplingConfig(), eos)
    reference = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
                               max_new_tokens=args.max_new_tokens, eos_token_id=sorted(eos) or None,
                               pad_token_id=tokenizer.pad_token_id or 0)[0, len(prompt):].tolist()
    ends = [i for i, token in enumerate(reference) if token in eos]
    reference = reference[:ends[0] + 1] if ends else reference
    rounds = max(len(out.accept_lengths), 1)
    print(f"{head.kind} head ({meta.get('source_format')}) on {args.target}")
    print(tokenizer.decode(out.tokens))
    print(f"tau {sum(a + 1 for a in out.accept_lengths) / rounds:.2f} over {len(out.accept_lengths)} rounds; "
          f"identical to generate: {out.tokens == reference}")


if __name__ == "__main__":
    main()
