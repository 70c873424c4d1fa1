"""`draftsmith check EXPORT_DIR`: serving parity before deploying. A head that accepted well in validation
can accept far less once served, because what is served differs from what was trained: the chat template
or thinking mode, the layer-id convention, the draft's RoPE or norm settings, the draft-vocabulary map,
the dtype, or the target itself. This stage reads the export as the engine's loader reads it (through the
project's import of the engine layout), lints it against the recipe, the training record the export carries
(`draftsmith.json`, written by `draftsmith export`) and the target as it will be served, then decodes the
validation prompts with the imported head under the engine's rules (a chain of its K speculative tokens)
and compares tau and the outputs with the head's validation record.

Each finding is one line: what differs, what it costs, the fix. Any mismatch makes the exit code 1."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftsmith import artifacts
from draftsmith import recipe as recipe_mod
from draftsmith.heads.base import full_attention_rope, target_value
from draftsmith.heads.hf_layout import EXPORT_MARK, TORCH_DTYPE_NAMES

SIDECAR = "draftsmith.json"  # the training record an export carries; engines ignore it
TAU_TOLERANCE = 0.08  # relative tau loss (plus 0.05) still taken as equal: bf16 export weights, rounding


@dataclass
class Finding:
    code: str  # template | layer_ids | rope | norm | vocab | dtype | target | engine_keys | tau | outputs
    what: str
    cost: str
    fix: str

    def line(self) -> str:
        return f"MISMATCH [{self.code}] {self.what} -- costs: {self.cost} -- fix: {self.fix}"


def record(meta: dict, engine: str, validation: dict | None, head_path: Path, depth: int | None, dtype: str) -> dict:
    """The sidecar `draftsmith export` writes: what the head was trained on and how it validated."""
    data_manifest = head_path.parent / "data" / artifacts.MANIFEST
    data = artifacts.read_json(data_manifest) if data_manifest.exists() else {}
    keep = ("tau", "num_rounds", "acceptance_per_depth", "tree", "num_prompts", "max_new_tokens", "dtype", "device", "output_sha256")
    return {"kind": meta.get("kind"), "engine": engine, "export_dtype": dtype, "served_depth": depth,
            "target_id": meta.get("target_id"), "served_target": meta.get("served_target"),
            "target_fingerprint": data.get("target_fingerprint"), "template_hash": data.get("template_hash"),
            "layer_ids": meta.get("layer_ids"), "checkpoint": str(head_path.resolve()), "checkpoint_sha256": meta.get("sha256"),
            "recipe": _recipe_text(meta.get("recipe")),
            "validation": {k: validation[k] for k in keep if k in validation} | {
                "per_domain_tau": {d: s["tau"] for d, s in validation.get("per_domain", {}).items()}} if validation else None}


def _recipe_text(recipe: dict | None) -> str | None:
    """The checkpoint's resolved recipe as YAML; None where it no longer loads (a checkpoint older than a key's
    removal: `check` then asks for --recipe)."""
    try:
        return recipe_mod.dump(recipe_mod.loads(json.dumps(recipe))) if recipe else None
    except ValueError:
        return None


# ---------------------------------------------------------------- reading the export as the engine does


def read_export(export_dir: Path) -> tuple[dict, dict, dict]:
    """(config.json, the training record or {}, the tensors) of an exported head directory."""
    from draftsmith.heads.hf_layout import read_weights
    if not (export_dir / "config.json").exists():
        raise FileNotFoundError(f"{export_dir}: no config.json (pass an exported head directory: <run>/export/<engine>)")
    raw = json.loads((export_dir / "config.json").read_text())
    sidecar = json.loads((export_dir / SIDECAR).read_text()) if (export_dir / SIDECAR).exists() else {}
    return raw, sidecar, read_weights(export_dir)


def engine_of(raw: dict, sidecar: dict, chosen: str | None) -> str:
    if chosen:
        return chosen
    if "speculators_model_type" in raw:
        return "speculators"
    return (raw.get(EXPORT_MARK) or {}).get("engine") or sidecar.get("engine") or "sglang"


def layer_config(raw: dict) -> dict:
    """The draft layer's keys as the engine reads them (speculators nests them)."""
    return raw.get("transformer_layer_config") or raw


def served_depth(raw: dict, sidecar: dict) -> int:
    """K, the speculative tokens the serve command gives the engine."""
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(sidecar.get("served_depth") or methods[0].get("speculative_tokens") or 3)


# ---------------------------------------------------------------- lints


def lint_layer_ids(imported: list[int] | None, trained: list[int] | None, num_layers: int, engine: str) -> list[Finding]:
    """The aux layer ids the engine will capture (read under its convention) against those the head was trained on."""
    if not imported or not trained or list(imported) == list(trained):
        out = []
    else:
        shift = {imported[i] - trained[i] for i in range(min(len(imported), len(trained)))}
        out = [Finding("layer_ids", f"{engine} will feed the head layers {imported} (read under its convention), the head "
                       f"was trained on {trained} (input-to-layer)" + (f", off by {shift.pop():+d}" if len(shift) == 1 else ""),
                       "the head sees other features than it learned: acceptance collapses (SpecForge #455, #473)",
                       f"re-export with `draftsmith export --to {engine}` (SGLang configs hold ids - 1, vLLM and "
                       "speculators the input-to-layer ids), or fix eagle_aux_hidden_state_layer_ids")]
    bad = [i for i in imported or [] if not 0 <= i < num_layers]
    if bad:
        out.append(Finding("layer_ids", f"aux layer ids {bad} lie outside the target's {num_layers} layers",
                           "the engine fails to load the head, or captures nothing", "set ids in [0, num_hidden_layers)"))
    return out


def _target_rope(t) -> tuple[float, dict | None]:
    rope = full_attention_rope(t)
    theta = rope.get("rope_theta") or target_value(t, "rope_theta", [])
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return float(theta), (scaling if scaling.get("rope_type", "default") != "default" else None)


def _scaling_type(scaling: dict | None) -> str:
    return "default" if not scaling else str(scaling.get("rope_type") or scaling.get("type") or "default")


def lint_rope_norm(raw: dict, target_config) -> list[Finding]:
    """RoPE theta and scaling, and the norm epsilon, the engine builds the draft layer with, against the target's."""
    layer, t, out = layer_config(raw), target_config.get_text_config(), []
    theta, scaling = _target_rope(t)
    if layer.get("rope_theta") is not None and float(layer["rope_theta"]) != theta:
        out.append(Finding("rope", f"the draft's rope_theta is {layer['rope_theta']}, the target's {theta}",
                           "positions rotate at another frequency than in training: acceptance falls with distance",
                           f"set rope_theta: {theta} in config.json (draftsmith exports copy the target's)"))
    ours = layer.get("rope_scaling") or layer.get("rope_parameters")
    if _scaling_type(ours) != _scaling_type(scaling) or (scaling and "mrope_section" in scaling and "mrope_section" not in (ours or {})):
        out.append(Finding("rope", f"the draft's rope scaling is {json.dumps(ours)}, the target's {json.dumps(scaling)}",
                           "long or multimodal positions are rotated differently (speculators #598: a stripped "
                           "mrope_section accepted 0%)", f"set rope_scaling to {json.dumps(scaling)}"))
    eps = target_value(t, "rms_norm_eps", [])
    if layer.get("rms_norm_eps") is not None and abs(float(layer["rms_norm_eps"]) - eps) > 1e-12:
        out.append(Finding("norm", f"the draft's rms_norm_eps is {layer['rms_norm_eps']}, the target's {eps}",
                           "the draft's norms scale features differently than in training", f"set rms_norm_eps: {eps}"))
    return out


def trained_d2t(sidecar: dict) -> torch.Tensor | None:
    """The checkpoint's own map, where the export's record names a checkpoint still on disk."""
    path = Path(sidecar.get("checkpoint") or "/nonexistent")
    if not (path / "model.safetensors").exists():
        return None
    tensors, _ = artifacts.load_checkpoint(path)
    return tensors.get("d2t")


def lint_vocab(raw: dict, tensors: dict, vocab_size: int, reference: torch.Tensor | None = None) -> list[Finding]:
    """The draft-vocabulary map an engine needs to turn draft ids into target ids (and the checkpoint's, where known)."""
    draft_vocab = raw.get("draft_vocab_size")
    if not draft_vocab or draft_vocab >= vocab_size:
        return []
    d2t = tensors.get("d2t", tensors.get("draft_id_to_target_id"))
    if d2t is None:
        return [Finding("vocab", f"draft_vocab_size is {draft_vocab} < the target's {vocab_size}, but the weights hold no d2t",
                        "engines map draft id i to target id i: nearly every draft token is wrong (~0% acceptance)",
                        "re-export from the checkpoint (it holds d2t), or add d2t to model.safetensors")]
    targets = torch.arange(len(d2t)) + d2t.long()
    if len(d2t) != draft_vocab or bool((targets < 0).any() or (targets >= vocab_size).any()) or targets.unique().numel() != len(d2t):
        return [Finding("vocab", f"d2t holds {len(d2t)} entries for draft_vocab_size {draft_vocab}, mapping to "
                        f"{targets.unique().numel()} distinct ids in [{int(targets.min())}, {int(targets.max())}] (vocabulary {vocab_size})",
                        "draft tokens map to wrong or invalid target ids", "re-export from the checkpoint")]
    if reference is not None and (reference.shape != d2t.shape or not torch.equal(reference.long(), d2t.long())):
        wrong = int((reference.long() != d2t.long()).sum()) if reference.shape == d2t.shape else len(d2t)
        return [Finding("vocab", f"d2t differs from the trained checkpoint's on {wrong}/{len(d2t)} draft ids",
                        "those draft tokens are proposed as other target tokens and rejected", "re-export from the checkpoint")]
    return []


def lint_dtype(raw: dict, tensors: dict, served_dtype: torch.dtype) -> list[Finding]:
    """The dtype keys the loaders read, the weights' own dtype, and the dtype the target is served in."""
    names = {raw.get(k) for k in ("dtype", "torch_dtype") if raw.get(k)}
    floats = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    out = []
    if len(names) > 1 or (names and floats and names != floats):
        out.append(Finding("dtype", f"config.json says {sorted(names)}, the weights are {sorted(floats)}",
                           "loaders that trust the config (transformers 5 reads `dtype`, engines `torch_dtype`) cast "
                           "differently from those that trust the weights", "re-export with export.dtype set to the served dtype"))
    served = str(served_dtype).removeprefix("torch.")
    if floats and served in TORCH_DTYPE_NAMES.values() and served != "float32" and floats != {served}:
        out.append(Finding("dtype", f"the head is {sorted(floats)}, the target serves in {served}",
                           "the engine casts the head at load, or refuses it", f"re-export with export.dtype matching {served}"))
    return out


def lint_target(raw: dict, sidecar: dict, served: str, served_fingerprint: str | None) -> list[Finding]:
    """The target the export names (speculators' verifier, the record) against the one it will be served next to."""
    from draftsmith.targets import gguf
    named = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    trained = sidecar.get("target_id")
    accepted = {served, sidecar.get("served_target"), trained} - {None, ""}
    if gguf.is_gguf(served):
        accepted.add(str(gguf.local_file(served).resolve()) if gguf.is_local(served) else served)
    out = []
    if named and named not in accepted:
        out.append(Finding("target", f"the export names verifier {named!r}, it will be served with {served!r}",
                           "speculators/vLLM load the verifier it names: another model than the one the head was trained on",
                           f"re-export (`draftsmith export`) with target.model: {served}"))
    if trained and served_fingerprint and sidecar.get("target_fingerprint") not in (None, served_fingerprint):
        out.append(Finding("target", f"{served} is not the model the head was trained on ({trained}: fingerprint "
                           f"{sidecar['target_fingerprint']}, now {served_fingerprint})",
                           "another checkpoint, revision or quantization shifts the features the head reads",
                           "train the head on the target you serve (the data, capture and train stages rerun)"))
    return out


def lint_engine_keys(raw: dict, kind: str, engine: str) -> list[Finding]:
    """Keys an engine reads in a way of its own (an EAGLE-3 head's)."""
    if kind != "eagle3":
        return []
    out = []
    if engine in ("sglang", "vllm") and "Eagle3" not in "".join(raw.get("architectures") or []):
        out.append(Finding("engine_keys", f"architectures {raw.get('architectures')} names no Eagle3 class",
                           f"{engine} loads it as a plain Llama draft (EAGLE-1), without the fused features",
                           "set architectures: [LlamaForCausalLMEagle3]"))
    if layer_config(raw).get("tie_word_embeddings"):
        out.append(Finding("engine_keys", "tie_word_embeddings is true", "the engine ties the draft lm_head to the "
                           "embedding and drops the trained lm_head", "set tie_word_embeddings: false"))
    return out


def served_tokenizer(model: str, dtype: str):
    """The tokenizer an engine serves the target with: its own chat template (no recipe override)."""
    from transformers import AutoTokenizer
    from draftsmith.targets.loading import local_model
    return AutoTokenizer.from_pretrained(local_model(model, dtype))


def lint_template(recipe, served_tokenizer, serve_kwargs: dict, sidecar: dict) -> list[Finding]:
    """A probe conversation rendered as the data stage rendered it and as the engine will (the served target's own
    template, the request's chat_template_kwargs): thinking mode, template and system prompt must agree."""
    from draftsmith.data.conversations import render, template_hash
    from draftsmith.targets.loading import load_tokenizer
    trained_tok = load_tokenizer(recipe)
    probe = [{"role": "user", "content": "Write a function that adds two numbers."}]
    as_trained = render(trained_tok, ([{"role": "system", "content": recipe.data.system_prompt}] if recipe.data.system_prompt
                                      else []) + probe, generation_prompt=True)
    served_tokenizer.draftsmith_template_kwargs = dict(serve_kwargs)
    as_served = render(served_tokenizer, probe, generation_prompt=True)
    out = []
    trained_kwargs = dict(recipe.data.chat_template_kwargs)
    if as_trained != as_served:
        start = next((i for i, (a, b) in enumerate(zip(as_trained, as_served)) if a != b), min(len(as_trained), len(as_served)))
        thinking = trained_kwargs.get("enable_thinking") != serve_kwargs.get("enable_thinking")
        what = (f"thinking: the data was rendered with enable_thinking={trained_kwargs.get('enable_thinking')}, the engine "
                f"renders with {serve_kwargs.get('enable_thinking')} (its default)" if thinking else
                "the prompt the data was rendered with differs from the one the engine renders")
        out.append(Finding("template", f"{what}; first difference at character {start}: trained "
                           f"{as_trained[start:start + 40]!r}, served {as_served[start:start + 40]!r}",
                           "the head drafts for another output style than the one served (z-lab/dflash #133: data with "
                           "thinking off, serving with it on)", "regenerate the data with data.chat_template_kwargs, "
                           "data.system_prompt and target.chat_template as served, or serve with the trained ones "
                           f"(chat_template_kwargs {json.dumps(trained_kwargs)})"))
    if sidecar.get("template_hash") and sidecar["template_hash"] != template_hash(served_tokenizer) and not recipe.target.chat_template:
        out.append(Finding("template", f"the served tokenizer's chat template (hash {template_hash(served_tokenizer)}) is "
                           f"not the one the data was rendered with ({sidecar['template_hash']})",
                           "prompts are tokenized differently than in training", "rerun the data stage on the served target"))
    return out


# ---------------------------------------------------------------- decoding under the engine's rules


def decode(recipe, export_dir: Path, depth: int, num_prompts: int) -> dict:
    """The imported head (as the engine's loader reads the export) decoding the validation prompts greedily
    in a chain of `depth`, as the engines' serve commands run it: tau, acceptance and each output's digest."""
    from draftsmith.heads.drafting import TreeConfig
    from draftsmith.heads.loading import load_head
    from draftsmith.heads.registry import head_spec
    from draftsmith.runtime.generate import acceptance_stats, output_digest, speculative_generate
    from draftsmith.runtime.loading import eos_ids, prompt_image_inputs, validation_prompts
    from draftsmith.runtime.target import TargetRunner
    from draftsmith.runtime.compile import step_compiler
    from draftsmith.runtime.verify import SamplingConfig
    from draftsmith.targets.loading import load_target, load_tokenizer, pick_device
    device = pick_device() if recipe.validate.device == "auto" else torch.device(recipe.validate.device)
    torch.manual_seed(recipe.seed)
    model, tokenizer = load_target(recipe, device), load_tokenizer(recipe)
    head, _ = load_head(export_dir, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    head = head.to(device=device, dtype=model.dtype)
    chosen = validation_prompts(recipe, tokenizer, num_prompts)
    prompts = [p.to(device) for p, _, _ in chosen]
    images = [prompt_image_inputs(tokenizer, p, sources, model) for p, _, sources in chosen]  # image prompts: their images
    max_len = max(len(p) for p in prompts) + recipe.validate.max_new_tokens + 2 * depth + 8
    runner = TargetRunner(model, max_len, head.config.get("draftsmith", {}).get("layer_ids", []))
    drafter = head_spec(head.kind).drafter(head, max_len, TreeConfig(depth, 1, depth + 1, None),
                                            step_compiler("auto", device))
    eos, accepted, digests = eos_ids(model, tokenizer), [], []
    for prompt, image in zip(prompts, images):
        out = speculative_generate(runner, drafter, prompt, recipe.validate.max_new_tokens, SamplingConfig(), eos,
                                   image_inputs=image)
        accepted += out.accept_lengths
        digests.append(output_digest(out.tokens))
    return {**acceptance_stats(accepted, depth), "depth": depth, "num_prompts": len(prompts), "output_sha256": digests,
            "dtype": str(model.dtype)}


def _chain_tau(alphas: list[float], depth: int) -> float:
    """tau of a chain of `depth` from conditional acceptance per depth: 1 + sum of the products."""
    tau, reach = 1.0, 1.0
    for a in alphas[:depth]:
        reach *= a
        tau += reach
    return tau


def compare_decoding(measured: dict, validation: dict | None, same_prompts: bool) -> list[Finding]:
    """tau and outputs of the served setting against the validation record."""
    if not validation:
        return []
    tree = validation.get("tree") or {}
    chain = tree.get("top_k", 1) == 1 and not tree.get("choices") and tree.get("depth") == measured["depth"]
    expected = validation["tau"] if chain else _chain_tau(validation.get("acceptance_per_depth", []), measured["depth"])
    out = []
    rounds = validation.get("num_rounds", 1)  # 0: every validated output ended at once, no tau to compare
    if rounds and measured["tau"] < expected * (1 - TAU_TOLERANCE) - 0.05:
        out.append(Finding("tau", f"served as the engine runs it (a chain of {measured['depth']}), the head reaches tau "
                           f"{measured['tau']:.2f}; validation {'measured' if chain else 'implies'} {expected:.2f}",
                           f"{1 - measured['tau'] / expected:.0%} fewer tokens per target forward than validated",
                           "the lines above name the cause; with none, re-export from the validated checkpoint"))
    recorded = validation.get("output_sha256") or []
    if same_prompts and recorded and validation.get("max_new_tokens") is not None:
        differ = sum(a != b for a, b in zip(measured["output_sha256"], recorded))
        if differ:
            out.append(Finding("outputs", f"greedy outputs differ from the validation record on {differ}/"
                               f"{min(len(recorded), len(measured['output_sha256']))} prompts",
                               "the served target, its dtype or the prompts' rendering is not what was validated "
                               "(greedy speculative output equals the target's own)",
                               "serve the validated target in the validated dtype with the validated template"))
    return out


# ---------------------------------------------------------------- the stage


def _recipe(recipe_path: str | None, sidecar: dict, export_dir: Path):
    if recipe_path:
        return recipe_mod.load(recipe_path)
    if sidecar.get("recipe"):
        return recipe_mod.loads(sidecar["recipe"], source=f"{export_dir / SIDECAR}")
    raise ValueError(f"{export_dir}: no {SIDECAR} (an export from elsewhere, or from before draftsmith wrote one): "
                     "pass --recipe R, the recipe the head was trained with")


def run_check(export_dir: str, recipe_path: str | None = None, prompts: str | None = None, target: str | None = None,
              engine: str | None = None, chat_template_kwargs: dict | None = None, num_prompts: int | None = None,
              lint_only: bool = False) -> dict:
    """Lint the export against the recipe, its record and the served target; then decode. Returns the findings."""
    from draftsmith.heads.loading import load_head
    from draftsmith.targets.loading import local_model, target_config, target_fingerprint
    path = Path(export_dir)
    raw, sidecar, tensors = read_export(path)
    recipe = _recipe(recipe_path, sidecar, path)
    trained_target = recipe.target.model
    recipe.target.model = target or trained_target
    if prompts:
        recipe.validate.prompts = prompts
    engine = engine_of(raw, sidecar, engine)
    config = target_config(local_model(recipe.target.model, recipe.target.dtype))
    try:  # the project's import of the engine's layout: ids read under its convention
        head, meta = load_head(path, config)
    except artifacts.ArtifactError as exc:
        head, meta = None, {}
        unloadable = Finding("load", f"the import of this {engine} layout fails: {exc}", "the engine refuses it or "
                             "loads it partly", "re-export from the validated checkpoint (`draftsmith export`)")
    kind = head.kind if head is not None else sidecar.get("kind", "unknown")
    trained_ids = sidecar.get("layer_ids") or (head.config.get("draftsmith", {}).get("layer_ids") if head is not None else None)
    if not sidecar.get("layer_ids") and recipe.capture.layer_ids:
        trained_ids = list(recipe.capture.layer_ids)
    text = config.get_text_config()
    from draftsmith.targets.loading import pick_device
    served_dtype = torch.bfloat16 if pick_device().type == "cuda" else torch.float32
    findings = (lint_target(raw, sidecar | {"target_id": sidecar.get("target_id") or trained_target}, recipe.target.model,
                            target_fingerprint(recipe.target.model))
                + lint_template(recipe, served_tokenizer(recipe.target.model, recipe.target.dtype), chat_template_kwargs or {}, sidecar)
                + lint_layer_ids(meta.get("layer_ids"), trained_ids, text.num_hidden_layers, engine)
                + lint_rope_norm(raw, config) + lint_vocab(raw, tensors, text.vocab_size, trained_d2t(sidecar))
                + lint_dtype(raw, tensors, served_dtype) + lint_engine_keys(raw, kind, engine))
    if head is None and not any(f.code == "vocab" for f in findings):
        findings.append(unloadable)
    result = {"export": str(path), "engine": engine, "kind": kind, "target": recipe.target.model}
    if not lint_only and head is not None:
        depth = served_depth(raw, sidecar)
        validation = sidecar.get("validation")
        count = num_prompts or (validation or {}).get("num_prompts") or recipe.validate.num_prompts
        measured = decode(recipe, path, depth, count)
        findings += compare_decoding(measured, validation, same_prompts=not prompts and count == (validation or {}).get("num_prompts"))
        result["decoding"] = {k: v for k, v in measured.items() if k != "output_sha256"} | {
            "validated_tau": (validation or {}).get("tau")}
    result["findings"] = [asdict(f) for f in findings]
    result["lines"] = [f.line() for f in findings]
    return result


def render_check(result: dict) -> str:
    """The stage's printout: one line per finding, then the verdict."""
    lines = [f"draftsmith check {result['export']} ({result['kind']} for {result['engine']}, target {result['target']})"]
    decoding = result.get("decoding")
    if decoding:
        validated = decoding.get("validated_tau")
        lines.append(f"  decoded {decoding['num_prompts']} prompts as {result['engine']} serves it (chain of {decoding['depth']}): "
                     f"tau {decoding['tau']:.2f}" + (f", validated {validated:.2f}" if validated is not None else ", no validation record"))
    lines += [f"  {line}" for line in result["lines"]]
    lines.append(f"  {len(result['lines'])} mismatch(es): do not deploy as is" if result["lines"] else "  OK: no mismatch found")
    return "\n".join(lines)
