"""What every bench section shares: the machine line, a scratch copy of the demo's data stage."""
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


def link_data(recipe, source_recipe) -> None:
    """A fresh copy of the demo's data stage (same inputs hash) in a scratch run directory."""
    import shutil
    dst = recipe.run_dir / "data"
    shutil.rmtree(dst, ignore_errors=True)
    recipe.run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source_recipe.run_dir / "data", dst)
    shutil.rmtree(recipe.run_dir / "train", ignore_errors=True)  # always a fresh training run

