"""The three scripts in examples/ run as a user runs them, and do what they say."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from draftsmith.runtime.export import export_head
from draftsmith.runtime.validate import run_validate, validation_is_current
from draftsmith.train.trainer import head_dir

EXAMPLES = ROOT / "examples"


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def validated(micro_pipeline):
    if not validation_is_current(micro_pipeline):
        run_validate(micro_pipeline)
    return micro_pipeline


def test_examples_are_short_and_documented():
    scripts = sorted(EXAMPLES.glob("*.py"))
    assert [s.name for s in scripts] == ["decode_with_export.py", "economics_sweep.py", "train_head.py"]
    for script in scripts:
        text = script.read_text()
        assert text.startswith('"""') and "python examples/" in text and len(text.splitlines()) < 80


def test_decode_with_an_exported_head(validated, tmp_path):
    export_head(str(head_dir(validated)), "speculators", str(tmp_path / "speculators"))
    out = _run(str(EXAMPLES / "decode_with_export.py"), str(tmp_path / "speculators"), validated.target.model, "--depth", "2")
    assert "eagle3 head (speculators)" in out and "identical to generate: True" in out


def test_economics_sweep_plots_a_validation(validated, tmp_path):
    report = validated.run_dir / "validate" / "validation.json"
    out = _run(str(EXAMPLES / "economics_sweep.py"), str(report), "--out", str(tmp_path / "economics.png"))
    assert (tmp_path / "economics.png").stat().st_size > 1000
    depth = len(json.loads(report.read_text())["acceptance_per_depth"])
    assert "best K" in out and f"at depth {depth}" in out


@pytest.mark.long
def test_train_a_head_from_python(micro_target, tmp_path):
    out = _run(str(EXAMPLES / "train_head.py"), "recipes/demo/micro-eagle3.yaml", f"out_dir={tmp_path}",
               f"target.model={micro_target}", "target.embedded.train_seconds=600", "target.embedded.max_steps=150",
               "train.max_steps=3", "validate.num_prompts=2")
    assert "eagle3 head for" in out and "exact against generate: True" in out
    assert (tmp_path / "micro-eagle3" / "head" / "model.safetensors").exists()
