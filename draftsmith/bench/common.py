"""What every bench section shares: the machine line, a scratch copy of the demo's data stage, tiny targets of other
architectures trained on the demo's corpus."""
from __future__ import annotations

import platform
from pathlib import Path

import torch


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {torch.get_num_threads()} threads, {gpu}, torch {torch.__version__}"


def cpu_of(measured: str) -> str:
    """The CPU of a section's `measured` line, '<date>, ' + `machine()` ('' where the line names none)."""
    parts = measured.split(", ")
    return parts[1] if len(parts) > 1 else ""


def link_data(recipe, source_recipe) -> None:
    """A fresh copy of the demo's data stage (same inputs hash) in a scratch run directory."""
    import shutil
    dst = recipe.run_dir / "data"
    shutil.rmtree(dst, ignore_errors=True)
    recipe.run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source_recipe.run_dir / "data", dst)
    shutil.rmtree(recipe.run_dir / "train", ignore_errors=True)  # always a fresh training run



def corpus_target(model_type: str, demo_target: Path, out: Path, embedded, steps: int, **sizes) -> Path:
    """A tiny `model_type` target with the demo's tokenizer, trained `steps` on the demo's corpus the way the embedded
    target is (so its text is code, not noise), saved with the tokenizer at `out`."""
    import dataclasses

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from draftsmith.targets.embedded import train_on_corpus
    tokenizer = AutoTokenizer.from_pretrained(demo_target)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), max_position_embeddings=4096,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, **sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    train_on_corpus(model, tokenizer, dataclasses.replace(embedded, max_steps=steps), desc=f"{model_type} target")
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def fmt_values(values) -> str:
    """A table cell of numbers: two decimals each, `-` for none."""
    return ", ".join(f"{x:.2f}" for x in values if x is not None) if values else "-"


def in_fresh_process(fn, *args) -> None:
    """Run `fn(*args)` in a new (spawned) Python process and wait for it. Timings taken in the process that has just
    trained and validated the heads came out skewed: its verify forwards at B = 128 took 1.5x those of a fresh
    process against plain decoding's 1.05x (2026-12-06), pulling every speculative cell at large batch sizes down."""
    import multiprocessing
    job = multiprocessing.get_context("spawn").Process(target=fn, args=args)
    job.start()
    job.join()
    if job.exitcode != 0:
        raise RuntimeError(f"{fn.__name__} failed in its own process (exit code {job.exitcode}): its output is above")
