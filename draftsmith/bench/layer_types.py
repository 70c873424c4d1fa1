"""`make bench`, section `layer_types`: validation on a windowed and on a hybrid (linear attention + full attention)
target, with prompts several windows long: tau, speedup over plain decoding, exactness against our plain decoding
and against the model's own `generate`.

- windowed: the demo target's trained weights in Mistral's architecture (Llama's layers with a sliding window) with a
  32-token window, so the text is the demo's and every prompt spans several windows; its head starts from the
  demo's head and trains on the windowed target's own regenerated answers.
- hybrid: a tiny Qwen3-Next (gated DeltaNet and full attention, MoE) with the demo's tokenizer, trained briefly on the
  demo's corpus the way the embedded target is (so its text is code, not noise), and a head trained from scratch on
  its own regenerated answers, drafting chains (recurrent layers)."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from draftsmith.bench.common import corpus_target

WINDOW = 32
COMMON = ["data.max_conversations=400", "data.regen.max_new_tokens=96", "validate.num_prompts=8",
          "validate.max_new_tokens=96", "validate.min_tau=null", "train.epochs=1", "train.eval_every=100000"]


def _windowed(demo_target: Path, out: Path) -> Path:
    from transformers import AutoTokenizer, LlamaForCausalLM, MistralConfig, MistralForCausalLM
    llama = LlamaForCausalLM.from_pretrained(demo_target)
    fields = {k: v for k, v in llama.config.to_dict().items() if k in MistralConfig().to_dict()}
    config = MistralConfig(**{**fields, "sliding_window": WINDOW, "architectures": ["MistralForCausalLM"]})
    model = MistralForCausalLM(config)
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"the demo target's weights do not fit Mistral's layers: {missing or unexpected}")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(demo_target).save_pretrained(out)
    return out


def _hybrid(demo_target: Path, out: Path, embedded=None, steps: int = 200) -> Path:
    return corpus_target("qwen3_next", demo_target, out, embedded, steps, hidden_size=128, intermediate_size=256,
                         moe_intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, num_experts=4, num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2)


def bench_layer_types(recipe_path: str, overrides: list[str], train_steps: int = 300) -> dict:
    from draftsmith import recipe as recipe_mod
    from draftsmith.stages import run_all
    demo = recipe_mod.load(recipe_path, overrides)
    demo_target = Path(demo.target.model)
    scratch = Path(demo.out_dir) / "bench-layer-types"
    shutil.rmtree(scratch, ignore_errors=True)
    runs = {"windowed (Mistral layers, 32-token window)": (_windowed, [f"head.init_from={demo.run_dir / 'head'}"]),
            "hybrid (Qwen3-Next: gated DeltaNet + full attention, MoE)": (
                lambda target, out: _hybrid(target, out, demo.target.embedded),
                ["validate.top_k=1", "validate.depth=6", "validate.num_nodes=7"])}
    out = {}
    for label, (build, extra) in runs.items():
        name = label.split()[0]
        target = build(demo_target, scratch / "targets" / name)
        recipe = recipe_mod.load(recipe_path, overrides + [
            f"name=bench-{name}", f"out_dir={scratch}", f"target.model={target}", "target.embedded=null",
            "economics.draft_model_embedded=null",
            f"train.max_steps={train_steps}", *COMMON, *extra])
        started = time.perf_counter()
        run_all(recipe)
        v = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())
        out[label] = {"tau": v["tau"], "speedup_vs_plain": v["speedup_vs_plain"], "exact_match": v["exact_match"],
                      "num_exact": v.get("num_exact"), "num_exact_vs_generate": v.get("num_exact_vs_generate"),
                      "exact_vs_generate": v["exact_vs_generate"], "num_prompts": v.get("num_prompts"),
                      "positions": list((v.get("screen") or {}).get("per_position", {})), "tree": v["tree"], "window": WINDOW,
                      "pipeline_seconds": time.perf_counter() - started, "train_steps": train_steps}
    return out


def render_layer_types(r: dict) -> list[str]:
    rows = r.get("layer_types")
    if not rows:
        return []
    lines = ["## Today's layer types in the runtime", "",
             "Validation on a windowed and a hybrid target (`draftsmith/bench/layer_types.py`): the windowed one is the demo "
             f"target's weights with a {WINDOW}-token sliding window (every prompt spans several windows), its head started "
             "from the demo's; the hybrid one is a tiny Qwen3-Next (gated DeltaNet + full attention, MoE) trained 200 steps "
             "on the demo's corpus, drafting chains (a chain kept in part gets the recurrent states after its last "
             "accepted token by running the recurrent mixers alone again over their recorded inputs, which the speedup includes). Each head trains on its target's own regenerated answers. Exact = speculative output equal to our "
             "plain decoding and to the model's own `generate`, on every prompt.", "",
             "| target | tree | context positions drafted at | tau | speedup vs plain | exact vs plain | exact vs generate |",
             "|---|---|---|---|---|---|---|"]
    for label, row in rows.items():
        tree = row["tree"]
        lines.append(f"| {label} | depth {tree['depth']}, top-k {tree['top_k']}, {tree['num_nodes']} nodes | "
                     f"{', '.join(row['positions'])} | {row['tau']:.2f} | "
                     f"{row['speedup_vs_plain']:.2f}x | {row['num_exact']}/{row['num_prompts']} | "
                     f"{row['num_exact_vs_generate']}/{row['num_prompts']} |")
    return lines + [""]
