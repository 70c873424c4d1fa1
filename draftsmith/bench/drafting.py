"""`make bench` section `drafting`: one draft round (draft K tokens, then extend by the K + 1 accepted)
against the batch size, for every head kind and both baselines, batched (one drafter of B rows: one
draft forward per depth for the batch) against row by row (B drafters of one row each, as the runtime
drafted before). Timing only: heads of every kind are built fresh from the demo's recipes on the demo
target (weights do not change the work a round does), features are the target's own for each prompt."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from draftsmith import recipe as recipe_mod

ROOT = Path(__file__).resolve().parent.parent
KIND_RECIPES = {"eagle3": "recipes/demo/stdlib-code-eagle3.yaml", "eagle2": "recipes/demo/stdlib-code-eagle2.yaml",
                "mtp": "recipes/demo/stdlib-code-mtp.yaml", "medusa": "recipes/demo/stdlib-code-medusa1.yaml"}
SIZES = (1, 2, 4, 8, 16, 32, 64)


def _factories(recipe, model, tokenizer, k: int, max_len: int) -> dict:
    """name -> (layer ids the drafter's features come from, factory(batch_size) -> drafter)."""
    from draftsmith.data.capture import layer_ids_for
    from draftsmith.heads.eagle_layer import DEFAULT_DRAFT_VOCAB
    from draftsmith.heads.registry import head_spec
    from draftsmith.runtime.baselines import DraftModelDrafter, NgramDrafter, chain_config
    text = model.config.get_text_config()
    embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    out = {}
    for kind, path in KIND_RECIPES.items():
        head_cfg = recipe_mod.load(ROOT / path, [f"target.model={recipe.target.model}"]).head
        head_cfg.draft_vocab_size = min(head_cfg.draft_vocab_size or DEFAULT_DRAFT_VOCAB, text.vocab_size)
        spec = head_spec(kind)
        layer_ids = layer_ids_for(recipe, text.num_hidden_layers, spec.features)
        torch.manual_seed(0)
        head = spec.model.from_target(model.config, head_cfg, layer_ids)
        head.load_target_weights(embed, lm_head)
        head = head.to(dtype=model.dtype).eval()
        out[kind] = (layer_ids, lambda b, spec=spec, head=head: spec.drafter(head, max_len, chain_config(k), batch_size=b))
    cfg = recipe.economics
    out["ngram"] = ([], lambda b: NgramDrafter(k, cfg.ngram_max, cfg.ngram_min, batch_size=b))
    if cfg.draft_model:
        from transformers import AutoModelForCausalLM
        from draftsmith.targets.embedded import ensure_draft_model
        if cfg.draft_model_embedded is not None:
            ensure_draft_model(recipe)
        small = AutoModelForCausalLM.from_pretrained(cfg.draft_model, dtype=model.dtype, attn_implementation="sdpa").eval()
        out["draft-model"] = ([], lambda b: DraftModelDrafter(small, max_len, k, batch_size=b))
    return out


def _start(drafter, rows: list[int], prompts: list[torch.Tensor], features: list[torch.Tensor]) -> None:
    if hasattr(drafter, "begin_rows"):
        drafter.begin_rows(rows, prompts)
    drafter.extend_rows(rows, [p[1:] for p in prompts], [f[:-1] for f in features])


def _round(drafter, rows: list[int], roots_B: torch.Tensor, features: list[torch.Tensor], k: int) -> None:
    """One round as the runtime runs it: draft every row's tree, then commit K + 1 positions per row
    (everything accepted: the longest extend a round can make)."""
    trees = drafter.draft_trees(roots_B)
    tokens = [torch.cat([t.tokens_N[1:k + 1], t.tokens_N[:1]])[:k + 1] for t in trees]
    drafter.extend_rows(rows, tokens, [f[-len(t):] for f, t in zip(features, tokens)])


def _time_rounds(drafters_and_rows, roots, prompts, features, k: int, num_rounds: int) -> float:
    """Seconds per round over `num_rounds`, every drafter restarted on its rows first (not timed)."""
    for drafter, rows in drafters_and_rows:
        drafter.reset()
        _start(drafter, list(range(len(rows))), [prompts[r] for r in rows], [features[r] for r in rows])
    for drafter, rows in drafters_and_rows:  # warm-up round
        _round(drafter, list(range(len(rows))), roots[rows], [features[r] for r in rows], k)
    start = time.perf_counter()
    for _ in range(num_rounds):
        for drafter, rows in drafters_and_rows:
            _round(drafter, list(range(len(rows))), roots[rows], [features[r] for r in rows], k)
    if roots.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / num_rounds


@torch.no_grad()
def bench_drafting(recipe, sizes=SIZES, k: int = 4, num_rounds: int = 6, row_by_row_max: int = 64) -> dict:
    from draftsmith.runtime.target import TargetRunner
    from draftsmith.runtime.loading import validation_prompts
    from draftsmith.targets.loading import load_target, load_tokenizer
    model, tokenizer = load_target(recipe), load_tokenizer(recipe)
    prompts = [p.to(model.device) for p, _, _ in validation_prompts(recipe, tokenizer, max(sizes))]
    prompts = [prompts[i % len(prompts)] for i in range(max(sizes))]
    max_len = max(len(p) for p in prompts) + (num_rounds + 2) * (k + 1) + k + 2
    out = {"k": k, "num_rounds": num_rounds, "sizes": list(sizes), "drafters": {}}
    for name, (layer_ids, factory) in _factories(recipe, model, tokenizer, k, max_len).items():
        runner = TargetRunner(model, max_len, layer_ids, compile_mode=None)
        features, roots = [], []
        for p in prompts:
            runner.reset()
            logits, aux, _ = runner.prefill(p)
            features.append(aux)
            roots.append(logits[-1].argmax())
        roots = torch.stack(roots)
        row = {"batched_ms": {}, "row_by_row_ms": {}}
        for b in sizes:
            row["batched_ms"][str(b)] = 1e3 * _time_rounds([(factory(b), list(range(b)))], roots, prompts, features, k, num_rounds)
            if b <= row_by_row_max:
                singles = [(factory(1), [r]) for r in range(b)]
                row["row_by_row_ms"][str(b)] = 1e3 * _time_rounds(singles, roots, prompts, features, k, num_rounds)
        base = row["batched_ms"][str(sizes[0])]
        row["batched_ratio"] = {b: ms / base for b, ms in row["batched_ms"].items()}
        row["row_by_row_ratio"] = {b: ms / base for b, ms in row["row_by_row_ms"].items()}
        out["drafters"][name] = row
        print(f"[bench] drafting {name}: B=16 batched {row['batched_ratio'].get('16', float('nan')):.2f}x B=1, "
              f"row by row {row['row_by_row_ratio'].get('16', float('nan')):.2f}x", flush=True)
    return out


def render_drafting(r: dict) -> list[str]:
    d = r.get("drafting")
    if not d:
        return []
    sizes = d["sizes"]
    lines = ["## Batched drafting (issue #22)", "",
             f"One draft round (K = {d['k']} tokens drafted per row as a chain, then the K + 1 accepted committed), "
             f"{r.get('measured', {}).get('drafting', r['date'])}; mean of {d['num_rounds']} rounds after one warm-up. "
             "*batched*: one drafter for the B rows (one draft forward per depth for the batch); *row by row*: B "
             "drafters of one row each, as the runtime drafted before. Heads built fresh on the demo target (timing "
             "only); features from the target. Goal: batched B = 16 at most 3x B = 1.", "",
             "| drafter | " + " | ".join(f"B={b}" for b in sizes) + " | B=16 / B=1 batched | B=16 / B=1 row by row |",
             "|---" * (len(sizes) + 3) + "|"]
    for name, row in d["drafters"].items():
        cells = [f"{row['batched_ms'][str(b)]:.1f} / {row['row_by_row_ms'][str(b)]:.1f}" if str(b) in row["row_by_row_ms"]
                 else f"{row['batched_ms'][str(b)]:.1f}" for b in sizes]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['batched_ratio'].get('16', float('nan')):.2f}x | "
                     f"{row['row_by_row_ratio'].get('16', float('nan')):.2f}x |")
    return lines + ["", "Cells: ms per round batched / row by row.", ""]
