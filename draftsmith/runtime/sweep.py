"""`draftsmith economics --recipe R`: what a head is worth across load, next to the baselines.

For every batch size (capped by memory) and every K (speculative tokens per row, one chain: vLLM's
`num_speculative_tokens`), batched decoding (runtime/batched.py) of the same prompts measures output
tokens/s, time per output token (TPOT) and time to first token (TTFT), plain (K = 0) and with each
drafter: the trained head, prompt-lookup n-gram and a small draft model (runtime/baselines.py).
Every speculative row is checked token for token against the plain batch's row. From the sweep:
the best K per batch size, the crossover (the batch size from which K = 0 wins), vLLM's
`num_speculative_tokens_per_batch_size` schedule and SGLang settings, Theorem 3.8's prediction
next to the measured speedup at batch size 1, and with a $/h price the cost per 1M output tokens,
the multiplier M and the break-even extra $/h. Writes economics.json, economics.md and plots.

Drafting is batched like verification: one drafter per (K, batch size) drafts every row in one draft
forward per depth (heads/drafting.py), so c(B), the draft step's cost relative to a plain decode step
at the same batch size, is measured per batch size and refits Theorem 3.8's prediction there."""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch

from draftsmith import artifacts
from draftsmith.heads.drafting import BatchOfOne, Commits
from draftsmith.heads.registry import head_spec
from draftsmith.recipe import Recipe
from draftsmith.runtime import economics as econ
from draftsmith.runtime.baselines import (
    DraftModelDrafter,
    NgramDrafter,
    chain_config,
    check_shared_tokenizer,
)
from draftsmith.runtime.batched import BatchRunner, batch_max_len, batched_generate
from draftsmith.runtime.target import TargetRunner
from draftsmith.runtime.verify import SamplingConfig
from draftsmith.targets.parallel import is_first_rank


def economics_dir(recipe: Recipe) -> Path:
    return recipe.run_dir / "economics"


def _settings_hash(recipe: Recipe) -> str:
    """What the sweep's figures depend on besides the weights: its own section and the prompts' source."""
    return f"{recipe.section_hash('economics')}-{recipe.section_hash('validate')}"


def economics_is_current(recipe: Recipe) -> bool:
    """economics.json exists for the run's current head weights and these economics/validate settings."""
    from draftsmith.runtime.loading import head_sha
    path = economics_dir(recipe) / "economics.json"
    if not path.exists():
        return False
    data = artifacts.read_json(path)
    return data.get("head_sha256") == head_sha(recipe.run_dir / "head") and data.get("settings_hash") == _settings_hash(recipe)


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, no GPU"


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cache_bytes(config, batch_size: int, max_len: int, num_nodes: int, dtype: torch.dtype) -> int:
    """The static KV cache plus one verify forward's fp32 logits, for `batch_size` rows."""
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    element = torch.finfo(dtype).bits // 8
    kv = 2 * text.num_hidden_layers * batch_size * kv_heads * max_len * head_dim * element
    return kv + batch_size * num_nodes * text.vocab_size * 4


def _cell(results: list, plains: list | None = None) -> dict:
    """One grid cell from the batches that covered every prompt (tokens and seconds summed)."""
    tokens = sum(r.num_tokens for r in results)
    seconds = sum(r.seconds for r in results)
    cell = {"tokens_per_s": tokens / seconds, "tpot_ms": 1e3 * sum(r.tpot_seconds for r in results) / len(results),
            "ttft_ms": 1e3 * sum(r.ttft_seconds for r in results) / len(results), "num_tokens": tokens, "seconds": seconds,
            "num_batches": len(results), "num_rounds": sum(r.num_rounds for r in results)}
    if plains is not None:
        rounds = [a for r in results for row in r.accept_lengths for a in row]
        exact = [a == b for r, p in zip(results, plains) for a, b in zip(r.tokens, p.tokens)]
        cell.update(tau=sum(a + 1 for a in rounds) / max(len(rounds), 1), num_exact_rows=sum(exact), num_rows=len(exact),
                    draft_seconds=sum(r.draft_seconds for r in results), verify_seconds=sum(r.verify_seconds for r in results),
                    draft_ms_per_round=1e3 * sum(r.draft_seconds for r in results) / max(cell["num_rounds"], 1))
    return cell


class Sweep:
    """Runs the grid for one target; `drafters` maps a name to a factory `(k, batch_size) -> drafter` (one
    batched drafter serves every row). A batch size below the number of prompts runs several batches, so
    every cell decodes every prompt at least once."""

    def __init__(self, model, layer_ids, prompts, domains, eos, max_new_tokens, max_len, device, repeats: int = 1):
        self.model, self.layer_ids, self.prompts, self.domains = model, layer_ids, prompts, domains
        self.eos, self.max_new_tokens, self.max_len, self.device = eos, max_new_tokens, max_len, device
        self.repeats = repeats
        self.pools: dict[tuple[str, int, int], object] = {}
        self.row_accepts: dict[str, dict[str, list[int]]] = {}

    def _drafter(self, name: str, factory, k: int, batch_size: int):
        if (name, k, batch_size) not in self.pools:
            self.pools = {key: d for key, d in self.pools.items() if key[2] == batch_size}  # free other sizes' caches
            self.pools[(name, k, batch_size)] = factory(k, batch_size)
        return self.pools[(name, k, batch_size)]

    def _groups(self, batch_size: int) -> list[list[int]]:
        count = -(-len(self.prompts) // batch_size)
        return [[(g * batch_size + j) % len(self.prompts) for j in range(batch_size)] for g in range(count)]

    def run_batch(self, batch_size: int, drafters: dict, ks: dict[str, list[int]]) -> dict:
        """Every drafter's cells at one batch size. Plain decoding runs between the drafters (before the first, after
        each), so every speculative run has a plain run on either side: its speedup is its tokens/s over theirs, and a
        cell's is the median over `repeats` (a shared machine that slows or speeds up between runs moves a run and
        the plain runs beside it alike). A cell's `tokens_per_s` is that speedup times plain decoding's fastest run
        at this batch size; `measured_tokens_per_s` keeps its own fastest run."""
        groups = self._groups(batch_size)
        runner = BatchRunner(self.model, batch_size, self.max_len, self.layer_ids)
        greedy = SamplingConfig()
        batched_generate(runner, [self.prompts[i] for i in groups[0]], 4, greedy, self.eos)  # warm-up
        plains = self._plain(runner, groups)
        before = fastest = _cell(plains)
        out = {name: {} for name in drafters}
        ratios: dict[tuple[str, int], list[float]] = {}
        for repeat in range(self.repeats):  # every setting in turn, then again in reverse order: a slow spell, or a
            # machine that slows as a batch size's caches pile up, hits no drafter's every run
            for name, factory in (list(drafters.items()) if repeat % 2 == 0 else list(drafters.items())[::-1]):
                runs = []
                for k in ks[name]:
                    drafter = self._drafter(name, factory, k, batch_size)
                    results = [batched_generate(runner, [self.prompts[i] for i in g], self.max_new_tokens, greedy, self.eos,
                                                drafter) for g in groups]
                    cell = _cell(results, plains)
                    runs.append((k, cell["tokens_per_s"]))
                    if k not in out[name] or cell["seconds"] < out[name][k]["seconds"]:
                        out[name][k] = cell
                    if repeat == 0 and k == max(ks[name]):
                        self._collect(name, results, groups)
                after = _cell(self._plain(runner, groups))
                plain_tps = 2 * after["num_tokens"] / (before["seconds"] + after["seconds"])  # the runs on either side
                for k, tokens_per_s in runs:
                    ratios.setdefault((name, k), []).append(tokens_per_s / plain_tps)
                fastest = min(fastest, after, key=lambda c: c["seconds"])
                before = after
        for name in drafters:
            for k, cell in out[name].items():
                runs = sorted(ratios[(name, k)])
                speedup = (runs[(len(runs) - 1) // 2] + runs[len(runs) // 2]) / 2
                cell.update(speedup=speedup, measured_tokens_per_s=cell["tokens_per_s"], tokens_per_s=speedup * fastest["tokens_per_s"])
        out["plain"] = fastest
        return out

    def _plain(self, runner, groups: list[list[int]]) -> list:
        return [batched_generate(runner, [self.prompts[i] for i in g], self.max_new_tokens, SamplingConfig(), self.eos)
                for g in groups]

    def _collect(self, name: str, results: list, groups: list[list[int]]) -> None:
        by_domain = self.row_accepts.setdefault(name, {})
        for result, group in zip(results, groups):
            for accepts, index in zip(result.accept_lengths, group):
                by_domain.setdefault(self.domains[index], []).extend(accepts)


def draft_cost(drafter, model, layer_ids, prompt: torch.Tensor, max_len: int) -> float:
    """c: one draft step's latency over one plain target decode step's, each measured in isolation."""
    from draftsmith.runtime.timing import draft_step_cost
    return draft_step_cost(drafter, TargetRunner(model, max_len, layer_ids, compile_mode=None), prompt)


def summarize(name: str, cells: dict, plain: dict, gamma_c: float, usd: float | None, extra: float) -> dict:
    """Best K per batch size, crossover, schedule, the low-batch prediction and the cost table of one drafter."""
    sizes = sorted(cells)
    sweep = {b: {0: plain[b]["tokens_per_s"]} | {k: c["tokens_per_s"] for k, c in cells[b].items()} for b in sizes}
    schedule = econ.schedule(sweep)
    best = {b: max(sorted(sweep[b]), key=lambda k: (sweep[b][k], -k)) for b in sizes}
    crossover = next((b for i, b in enumerate(sizes) if all(best[s] == 0 for s in sizes[i:])), None)
    first = sizes[0]
    predicted = []
    for k, c in cells[first].items():
        predicted.append({"k": k, "tau": c["tau"], "alpha_iid": econ.alpha_from_tau(c["tau"], k),
                          "predicted": econ.walltime_factor(c["tau"], k, gamma_c),
                          "measured": c["tokens_per_s"] / plain[first]["tokens_per_s"]})
    by_size = {str(b): _at_batch_size(cells[b], plain[b], best[b]) for b in sizes}
    k1 = best[first] or max(cells[first], key=lambda k: cells[first][k]["tokens_per_s"])
    tau1 = cells[first][k1]["tau"]
    out = {"c": gamma_c, "best_k": {str(b): best[b] for b in sizes}, "schedule": schedule, "crossover_batch_size": crossover,
           "exact_rows": sum(c["num_exact_rows"] for b in sizes for c in cells[b].values()),
           "rows": sum(c["num_rows"] for b in sizes for c in cells[b].values()),
           "low_batch": {"batch_size": first, "k": k1, "tau": tau1, "alpha_iid": econ.alpha_from_tau(tau1, k1), "c": gamma_c,
                         "break_even_c": econ.break_even_cost(tau1, k1),
                         "predicted_walltime_factor": econ.walltime_factor(tau1, k1, gamma_c),
                         "measured_walltime_factor": cells[first][k1]["tokens_per_s"] / plain[first]["tokens_per_s"]},
           "predicted_vs_measured": predicted, "by_batch_size": by_size}
    if usd is not None:
        out["cost"] = {}
        for b in sizes:
            k = best[b] or k1
            spec = sweep[b][k]
            multiplier = spec / sweep[b][0]
            break_even = econ.break_even_extra_usd_per_hour(usd, multiplier)
            out["cost"][str(b)] = {
                "k": k, "plain_usd_per_mtok": econ.usd_per_million_tokens(usd, sweep[b][0]),
                "spec_usd_per_mtok": econ.usd_per_million_tokens(usd + extra, spec), "multiplier": multiplier,
                "break_even_extra_usd_per_hour": break_even, "extra_usd_per_hour": extra, "pays": extra < break_even}
    return out


def _at_batch_size(cells: dict, plain: dict, best_k: int) -> dict:
    """c(B) and Theorem 3.8 refit at one batch size: the draft step's cost over a plain decode step at the
    same batch size (draft seconds per round / K over plain seconds per round), at the best K (the
    largest when K = 0 wins), the predicted walltime factor with that c(B) next to the measured one."""
    k = best_k or max(cells)
    cell = cells[k]
    plain_step = plain["seconds"] / max(plain.get("num_rounds", 0), 1)
    c = cell.get("draft_seconds", 0.0) / max(cell.get("num_rounds", 0), 1) / k / plain_step
    return {"k": k, "c": c, "draft_ms_per_round": cell.get("draft_ms_per_round"), "tau": cell["tau"],
            "predicted_walltime_factor": econ.walltime_factor(cell["tau"], k, c),
            "measured_walltime_factor": cell["tokens_per_s"] / plain["tokens_per_s"]}


def sglang_settings(schedule: list[list[int]]) -> dict:
    """SGLang takes one K per server (EAGLE knobs: steps, topk, draft tokens incl. the root): the
    schedule's K at the smallest batch size, and up to which batch size speculation pays."""
    k = schedule[0][2]
    pays_until = max((end for start, end, kk in schedule if kk > 0), default=None)
    return {"speculative_num_steps": k, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": k + 1,
            "speculation_pays_up_to_batch_size": pays_until,
            "note": "SGLang has no per-batch-size K: beyond the batch size above, serve without speculation "
                    "(or cap --max-running-requests there)" if pays_until is not None else
                    "speculation did not pay at any measured batch size: serve without it"}


def vllm_config(name: str, kind: str, schedule: list[list[int]], model_path: str, cfg) -> dict:
    method = {"eagle3": "eagle3", "eagle2": "eagle", "medusa": "medusa", "mtp": "mtp", "ngram": "ngram",
              "draft-model": "draft_model"}.get(kind, kind)
    config = {"method": method, "num_speculative_tokens": max(k for _, _, k in schedule) or 1,
              "num_speculative_tokens_per_batch_size": schedule}
    if name == "ngram":
        config.update(prompt_lookup_max=cfg.ngram_max, prompt_lookup_min=cfg.ngram_min)
    elif model_path:
        config["model"] = model_path
    return config


def _usable_ks(name: str, factory, ks: list[int]) -> tuple[list[int], dict]:
    """The K values a drafter supports (a Medusa head drafts at most one token per head)."""
    usable, refused = [], {}
    for k in ks:
        try:
            factory(k)
            usable.append(k)
        except ValueError as exc:
            refused[str(k)] = str(exc)
    if not usable:
        raise ValueError(f"drafter {name!r} supports none of economics.num_speculative_tokens={ks}: {refused}")
    return usable, refused


def _load_partial(path: Path, key: dict) -> tuple[dict, dict]:
    """(grid, per-domain accept lengths) measured by an interrupted sweep of the same weights and settings."""
    if not path.exists():
        return {}, {}
    data = artifacts.read_json(path)
    if json.loads(json.dumps(key)) != data.get("key"):
        return {}, {}
    grid = {int(b): {name: cells if name == "plain" else {int(k): c for k, c in cells.items()} for name, cells in row.items()}
            for b, row in data["grid"].items()}
    return grid, data["row_accepts"]


def _drafter_factories(recipe: Recipe, draft_head, model, tokenizer, max_len: int, device) -> dict:
    cfg = recipe.economics
    spec = head_spec(draft_head.kind)
    factories = {draft_head.kind: lambda k, b=1: spec.drafter(draft_head, max_len, chain_config(k), batch_size=b)}
    if "ngram" in cfg.baselines:
        factories["ngram"] = lambda k, b=1: NgramDrafter(k, cfg.ngram_max, cfg.ngram_min, batch_size=b)
    if "draft-model" in cfg.baselines and cfg.draft_model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from draftsmith.targets.embedded import ensure_draft_model
        if cfg.draft_model_embedded is not None:
            ensure_draft_model(recipe)
        elif not Path(cfg.draft_model).exists() and "/" not in cfg.draft_model:
            raise ValueError(f"economics.draft_model={cfg.draft_model!r}: no such model directory")
        where = f"economics.draft_model={cfg.draft_model}"
        check_shared_tokenizer(tokenizer, AutoTokenizer.from_pretrained(cfg.draft_model), where)
        small = AutoModelForCausalLM.from_pretrained(cfg.draft_model, dtype=model.dtype, attn_implementation="sdpa").to(device).eval()
        factories["draft-model"] = lambda k, b=1: DraftModelDrafter(small, max_len, k, batch_size=b)
    return factories


def _layer_ids(head) -> list[int]:
    return list(head.config.get("draftsmith", {}).get("layer_ids", []))


def _columns(own: list[int], captured: list[int], hidden: int) -> torch.Tensor:
    """The feature columns of layers `own` in features captured at layers `captured` (hidden columns each)."""
    return torch.cat([torch.arange(captured.index(i) * hidden, (captured.index(i) + 1) * hidden) for i in own]) if own \
        else torch.zeros(0, dtype=torch.long)


class ReadingLayers(BatchOfOne):
    """A drafter in a sweep that captures more layers than it reads: what it commits keeps its own layers' columns."""

    def __init__(self, drafter, columns: torch.Tensor):
        self.drafter, self.columns = drafter, columns

    def commit(self, commits: Commits) -> None:
        feats = commits.feats_BTK
        self.drafter.commit(replace(commits, feats_BTK=feats[..., self.columns.to(feats.device)]))

    def __getattr__(self, name: str):
        return getattr(self.drafter, name)


def _reading(factory, columns: torch.Tensor):
    return lambda k, b=1: ReadingLayers(factory(k, b), columns)


def compared_heads(recipe: Recipe, model, taken: set[str]) -> dict:
    """{name: (head, path)} for `economics.compare`: other heads trained for this target, on its device and dtype,
    each named by its run directory (`runs/X/head` -> X)."""
    from draftsmith.heads.loading import load_head
    from draftsmith.runtime.loading import check_target
    from draftsmith.targets import parallel
    out = {}
    for entry in recipe.economics.compare:
        path = Path(entry)
        if not path.is_dir():
            raise ValueError(f"economics.compare: {entry!r} is not a directory (expected a head checkpoint or export)")
        name = path.parent.name if path.name in ("head", "") else path.name
        if name in taken or name in out:
            raise ValueError(f"economics.compare: {entry!r} is named {name!r}, which another drafter of the sweep "
                             "already has: compare heads from differently named runs")
        head, meta = load_head(path, model.config, parallel.full(model.get_input_embeddings().weight),
                               parallel.full(model.get_output_embeddings().weight))
        if head.config.get("draftsmith", {}).get("joint"):
            raise ValueError(f"economics.compare: {entry!r} was trained jointly with LoRA adapters on the target, so "
                             "it drafts for another (merged) target: sweep it with its own recipe")
        check_target(meta, model, recipe, where=f"economics.compare: {entry!r}")
        out[name] = (head.to(device=model.device, dtype=model.dtype), path)
    return out


def _prices(cfg, gpu_hour_usd: float | None, extra_usd_per_hour: float | None) -> tuple[float | None, float]:
    usd = gpu_hour_usd if gpu_hour_usd is not None else cfg.gpu_hour_usd
    extra = extra_usd_per_hour if extra_usd_per_hour is not None else cfg.extra_usd_per_hour
    if (usd is not None and usd <= 0) or extra < 0:
        raise ValueError(f"--gpu-hour-usd={usd}, --extra-usd-per-hour={extra}: expected a positive price and a non-negative extra")
    return usd, extra


def _measure_grid(sweep: Sweep, sizes: list[int], factories: dict, ks_by: dict, partial: Path, key: dict,
                  memory_fraction: float) -> tuple[dict, dict]:
    """{batch size: cells} for every size that fits in memory (and {size: why} for the others); each
    measured size is saved to `partial`, and sizes a killed run saved under the same `key` are kept."""
    from tqdm import tqdm
    grid, sweep.row_accepts = _load_partial(partial, key)
    free, skipped = _free_memory_bytes(sweep.device), {}
    num_nodes = max(max(ks) for ks in ks_by.values()) + 1
    bar = tqdm(sizes, desc="economics", unit="batch size", disable=not is_first_rank())
    for size in bar:
        need = cache_bytes(sweep.model.config, size, sweep.max_len, num_nodes, sweep.model.dtype)
        if need > memory_fraction * free:
            skipped[str(size)] = f"needs {need / 2**30:.2f} GiB of {free / 2**30:.2f} GiB free (economics.memory_fraction={memory_fraction})"
            continue
        if size in grid:
            continue  # measured before a kill, with these weights and settings
        bar.set_postfix(batch=size)
        grid[size] = sweep.run_batch(size, factories, ks_by)
        if is_first_rank():  # the ranks of a sharded target ran the same batches: one writes
            partial.parent.mkdir(parents=True, exist_ok=True)
            artifacts.write_json(partial, {"key": key, "grid": grid, "row_accepts": sweep.row_accepts})
    return {b: grid[b] for b in sizes if b in grid and str(b) not in skipped}, skipped


def _drafter_summary(name: str, kind: str, factory, sweep: Sweep, grid: dict, ks: list[int], usd, extra, model_path: str, cfg) -> dict:
    """What the report says of one drafter: c, the low-batch figures, schedule, cost, alpha per domain."""
    plain = {b: grid[b]["plain"] for b in grid}
    cells = {b: grid[b][name] for b in grid}
    c = draft_cost(factory(max(ks)), sweep.model, sweep.layer_ids, sweep.prompts[0], sweep.max_len)
    summary = summarize(name, cells, plain, c, usd, extra)
    per_domain = {}
    for domain, accepts in sorted(sweep.row_accepts.get(name, {}).items()):
        tau = sum(a + 1 for a in accepts) / max(len(accepts), 1)
        per_domain[domain] = {"tau": tau, "k": max(ks), "alpha_iid": econ.alpha_from_tau(tau, max(ks))}
    summary.update(kind=kind, per_domain=per_domain, cells={str(b): {str(k): v for k, v in cells[b].items()} for b in cells},
                   vllm_speculative_config=vllm_config(name, kind, summary["schedule"], model_path, cfg))
    return summary


# plain batched decoding builds its one-node trees for the whole batch and verifies every row in one pass (2026-12-06):
# sweeps before it set the speculative cells against a plain baseline slowed by a host step per row (a partial sweep of
# theirs does not resume into this one)
PLAIN_BASELINE = "one-pass"


def run_economics(recipe: Recipe, head: str | None = None, gpu_hour_usd: float | None = None,
                  extra_usd_per_hour: float | None = None, out: str | None = None) -> dict:
    from draftsmith.runtime.loading import eos_ids, head_sha, load_target_and_head, validation_prompts
    cfg = recipe.economics
    usd, extra = _prices(cfg, gpu_hour_usd, extra_usd_per_hour)
    model, tokenizer, draft_head, _, head_path = load_target_and_head(recipe, head, "economics")
    if draft_head.config.get("draftsmith", {}).get("joint"):  # served on the fine-tuned target
        from draftsmith.targets.lora import merge_adapter
        model = merge_adapter(model, head_path / "lora")
    chosen = validation_prompts(recipe, tokenizer, cfg.num_prompts)
    prompts, domains = [p.to(model.device) for p, _, _ in chosen], [d for _, d, _ in chosen]
    ks = sorted({k for k in (cfg.num_speculative_tokens or range(recipe.validate.depth + 1)) if k > 0})
    if not ks:
        raise ValueError(f"economics.num_speculative_tokens={cfg.num_speculative_tokens}: no K > 0 to measure")
    max_len = batch_max_len(prompts, cfg.max_new_tokens, max(ks) + 1)
    layer_ids = _layer_ids(draft_head)
    factories = _drafter_factories(recipe, draft_head, model, tokenizer, max_len, model.device)
    compared = compared_heads(recipe, model, set(factories))
    readers = {draft_head.kind: layer_ids} | {name: _layer_ids(other) for name, (other, _) in compared.items()}
    if len({bool(ids) for ids in readers.values()}) > 1:
        raise ValueError(f"economics.compare: heads that read the final hidden state and heads that read target layers "
                         f"({readers}) need different captures: compare heads of one of the two sorts")
    layer_ids = sorted({i for ids in readers.values() for i in ids})
    if compared:  # the target captures every layer any head reads; each head gets its own layers' columns
        for name, head in [(draft_head.kind, draft_head)] + [(n, other) for n, (other, _) in compared.items()]:
            factories[name] = _reading(factories[name] if name == draft_head.kind else
                                       lambda k, b=1, h=head: head_spec(h.kind).drafter(h, max_len, chain_config(k), batch_size=b),
                                       _columns(_layer_ids(head), layer_ids, model.config.get_text_config().hidden_size))
    ks_by, refused = {}, {}
    for name, factory in factories.items():
        ks_by[name], refused[name] = _usable_ks(name, factory, ks)
    sweep = Sweep(model, layer_ids, prompts, domains, eos_ids(model, tokenizer), cfg.max_new_tokens, max_len, model.device,
                  cfg.repeats)
    out_dir = Path(out) if out else economics_dir(recipe)
    partial = out_dir / "partial.json"  # each measured batch size, so a killed sweep resumes where it stopped
    key = {"head_sha256": head_sha(head_path), "settings_hash": _settings_hash(recipe), "ks": ks_by, "drafting": "batched",
           "plain_baseline": PLAIN_BASELINE,
           "compare": {name: head_sha(path) for name, (_, path) in compared.items()}}
    grid, skipped = _measure_grid(sweep, sorted(set(cfg.batch_sizes)), factories, ks_by, partial, key, cfg.memory_fraction)
    if not grid:
        raise ValueError(f"no batch size of economics.batch_sizes={cfg.batch_sizes} fits in memory: {skipped}")
    result = {"target": recipe.target.model, "head": str(head_path), "head_sha256": key["head_sha256"], "kind": draft_head.kind,
              "settings_hash": key["settings_hash"], "plain_baseline": PLAIN_BASELINE,
              "device": str(model.device), "machine": machine_name(model.device),
              "dtype": str(model.dtype), "date": time.strftime("%Y-%m-%d"), "max_new_tokens": cfg.max_new_tokens,
              "num_prompts": len(prompts), "batch_sizes": sorted(grid), "skipped_batch_sizes": skipped, "num_speculative_tokens": ks,
              "gpu_hour_usd": usd, "extra_usd_per_hour": extra, "plain": {str(b): grid[b]["plain"] for b in grid}, "drafters": {}}
    for name, factory in factories.items():
        model_path = str(recipe.run_dir / "export" / "vllm") if name == draft_head.kind else \
            str(compared[name][1]) if name in compared else (cfg.draft_model or "")
        kind = compared[name][0].kind if name in compared else name
        summary = _drafter_summary(name, kind, factory, sweep, grid, ks_by[name], usd, extra, model_path, cfg)
        summary["refused_k"] = refused[name]
        if name == draft_head.kind:
            summary["sglang"] = sglang_settings(summary["schedule"])
        result["drafters"][name] = summary
    if is_first_rank():
        from draftsmith.runtime.economics_report import write_economics_report
        write_economics_report(out_dir, result)
        partial.unlink(missing_ok=True)
    head_summary = result["drafters"][draft_head.kind]
    return {"report": str(out_dir / "economics.md"), "schedule": head_summary["schedule"],
            "crossover_batch_size": head_summary["crossover_batch_size"], "best_k_at_batch_1": head_summary["low_batch"]["k"]}
