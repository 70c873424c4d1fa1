"""`make bench` section `vlm` (issue #52): the image-text demo end to end. The embedded tiny Llama with a CLIP tower
in front, trained here to write the stdlib function an image begins; an EAGLE-3 head trained on its answers to image
and text conversations; validated on held-out image and text prompts, exact against `generate` with the images.

    python -m draftsmith.bench --sections vlm

Reported: tau on image prompts and on text prompts (`tau_image`, `tau_text`), acceptance by depth, the speedups, and
how well the target reads its images (`image_reading`: the drawn signature's characters it gives back in place)."""
from __future__ import annotations

import json

from draftsmith import artifacts
from draftsmith import recipe as recipe_mod

VLM_RECIPE = "recipes/demo/stdlib-vlm-eagle3.yaml"
_KEPT = ("tau", "acceptance_per_depth", "speedup_vs_plain", "speedup_vs_hf_generate", "num_prompts")


def bench_vlm(overrides: list[str]) -> dict:
    """The recipe's pipeline as `draftsmith run` runs it (stages already current are kept), then its records."""
    from draftsmith import stages
    recipe = recipe_mod.load(VLM_RECIPE, overrides)
    stages.run_all(recipe)
    target = artifacts.read_manifest(recipe.target.model, "target")
    report = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())
    per = {domain: {k: stats[k] for k in _KEPT if k in stats} for domain, stats in report["per_domain"].items()}
    return {"tau_image": per["image"]["tau"], "tau_text": per["text"]["tau"], "tau": report["tau"], "per_domain": per,
            "speedup_vs_plain": report["speedup_vs_plain"], "speedup_vs_hf_generate": report.get("speedup_vs_hf_generate"),
            "exact_vs_generate": f"{report['num_exact_vs_generate']}/{report['num_prompts']}",
            "target": {k: target.get(k) for k in ("num_parameters", "train_steps", "train_seconds", "heldout_perplexity",
                                                  "image_reading")}}


def render_vlm(r: dict) -> list[str]:
    row = r.get("vlm")
    if not row:
        return []
    measured = (r.get("measured") or {}).get("vlm", "")
    target, per = row["target"], row["per_domain"]
    reading = target.get("image_reading") or {}
    lines = ["## An image-text target: the image-text demo (issue #52)", "",
             f"Measured {measured or r['date'] + ', ' + r['machine']}, `{VLM_RECIPE}` end to end. The target: the demo's "
             f"tiny Llama with a CLIP tower in front ({target['num_parameters'] / 1e6:.2f}M parameters), trained "
             f"{target['train_steps']} steps ({target['train_seconds']:.0f} s) on stdlib source and on images of a "
             "function's start to write the function. It reads its images this well: "
             f"{reading.get('char_accuracy', 0):.2f} of the drawn signature's characters given back in place, "
             f"{reading.get('first_line_exact', 0):.2f} of first lines exact, {reading.get('distinct_first_lines', 0):.2f} "
             f"of first lines distinct ({reading.get('prompts', 0)} held-out images; a target that ignores its images "
             "gives one answer to all). The EAGLE-3 head trained on its answers to image and text conversations:", "",
             "| prompts | n | tau | alpha by depth | vs plain | vs generate |", "|---|---|---|---|---|---|"]
    for domain, stats in per.items():
        lines.append(f"| {domain} | {stats['num_prompts']} | {stats['tau']:.2f} | "
                     f"{' '.join(f'{a:.2f}' for a in stats['acceptance_per_depth'])} | {stats['speedup_vs_plain']:.2f}x | "
                     f"{stats.get('speedup_vs_hf_generate', 0):.2f}x |")
    lines += ["", f"tau_image {row['tau_image']:.2f} (goal 2.5: {'met' if row['tau_image'] >= 2.5 else 'not met'}), "
              f"tau_text {row['tau_text']:.2f}; greedy output equal to `generate` (with the images) on "
              f"{row['exact_vs_generate']} prompts."]
    if reading.get("first_line_exact", 0) < 0.5:
        lines[-1] += (" The target reads its images weakly (answers vary with the image, but most first lines are not "
                      "the drawn one), so the answers to image prompts vary less than the functions do, which makes "
                      "them easier to draft: read tau_image as an upper range for a target that reads well.")
    return lines + [""]
