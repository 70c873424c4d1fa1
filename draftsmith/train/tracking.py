"""Tracking behind one small interface: W&B on the main process (offline without an API key),
a null tracker elsewhere and in tests; a compact console line either way."""
from __future__ import annotations

import json
import os
from pathlib import Path


class NullTracker:
    def log(self, metrics: dict, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker:
    def __init__(self, recipe, run_dir: Path):
        import wandb
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        cfg = recipe.train.tracking
        self.run = wandb.init(project=cfg.project, name=cfg.run_name or recipe.name, tags=cfg.tags,
                              config=recipe.to_dict(), dir=str(run_dir), mode=os.environ.get("WANDB_MODE", mode),
                              resume="allow", id=f"{recipe.name}-{recipe.section_hash('train', 'head')}")

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


def make_tracker(recipe, run_dir: Path, is_main: bool):
    if not is_main or recipe.train.tracking.backend == "none":
        return NullTracker()
    return WandbTracker(recipe, run_dir)


class MetricsLog:
    """metrics.jsonl in the run directory (main process), and one short console line per log."""

    def __init__(self, path: Path, is_main: bool):
        self.path, self.is_main = path, is_main

    def write(self, record: dict, echo: bool = True) -> None:
        if not self.is_main:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if echo:
            keys = ["step", "loss", "acc_0", "acc_1", "sim_accept_len", "lr", "grad_norm", "tokens_per_s"]
            parts = [f"{k}={record[k]:.4g}" if isinstance(record.get(k), float) else f"{k}={record[k]}"
                     for k in keys if k in record]
            print(" ".join(f"{'eval ' if 'eval' in record else ''}{p}" for p in parts[:1]) + " " + " ".join(parts[1:]), flush=True)
