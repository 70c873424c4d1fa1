"""The CLI: help, clear errors with exit code 2, and `run` skipping stages by manifest."""

import pytest

from conftest import ROOT
from draftsmith import cli


def test_help_lists_every_stage(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for stage in ("target", "data", "capture", "train", "validate", "export", "run"):
        assert stage in out


def test_bad_recipe_key_exits_2_with_message(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntarget: {model: m}\ntrian: {lr: 1}\n")
    assert cli.main(["data", "--recipe", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'trian'" in err and str(bad) in err


def test_missing_target_dir_is_a_clear_error(tmp_path, capsys):
    code = cli.main(["data", "--recipe", str(ROOT / "recipes/demo/micro-eagle3.yaml"), f"out_dir={tmp_path}",
                     f"target.model={tmp_path}/missing-model"])
    assert code == 2 and "missing-model" in capsys.readouterr().err


@pytest.mark.slow
def test_run_skips_completed_stages(micro_pipeline, capsys):
    from draftsmith.stages import is_current
    recipe = micro_pipeline
    assert all(is_current(stage, recipe) for stage in ("target", "data", "capture", "train"))
    overrides = [f"out_dir={recipe.out_dir}", f"target.model={recipe.target.model}",
                 "target.embedded.train_seconds=600", "target.embedded.max_steps=150"]
    assert cli.main(["run", "--recipe", str(ROOT / "recipes/demo/micro-eagle3.yaml"), *overrides]) == 0
    out = capsys.readouterr().out
    for stage in ("target", "data", "capture", "train"):
        assert f"{stage}: up to date" in out
    assert "validate: running" in out and "tau" in out
    changed = [*overrides, "train.lr=0.001"]
    from draftsmith import recipe as recipe_mod
    assert not is_current("train", recipe_mod.load(ROOT / "recipes/demo/micro-eagle3.yaml", changed))
    assert is_current("capture", recipe_mod.load(ROOT / "recipes/demo/micro-eagle3.yaml", changed))
