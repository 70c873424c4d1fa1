"""The documentation: the README stays a landing page, and the generated references (docs/hooks.py, run by
`make docs`) cover every recipe key with its type, default and doc line, and every CLI stage."""
import dataclasses
import importlib.util
import typing
from pathlib import Path

from draftsmith import recipe as recipe_mod

ROOT = Path(__file__).resolve().parent.parent


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _keys(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name == "source_path":
            continue
        yield prefix + f.name
        inner = [a for a in (typing.get_args(hints[f.name]) or (hints[f.name],)) if dataclasses.is_dataclass(a)]
        if inner and typing.get_origin(hints[f.name]) is not list:
            yield from _keys(inner[0], f"{prefix}{f.name}.")


def test_readme_is_a_landing_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert readme.index("make demo") < readme.index("make test") < 1500
    for link in ("docs/guides/real-models.md", "BENCHMARKS.md", "CHANGELOG.md"):
        assert link in readme and (ROOT / link).exists()


def test_recipe_reference_documents_every_key():
    text = _hooks().recipe_reference()
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines() if line.startswith("| `")}
    keys = list(_keys(recipe_mod.Recipe))
    assert sorted(rows) == sorted(keys)
    undocumented = [key for key, row in rows.items() if row.rstrip().endswith("|  |")]
    assert not undocumented, f"recipe keys without a doc line in recipe.py: {undocumented}"
    assert "| eagle3, peagle |" in rows["head.draft_vocab_size"] and "| all |" in rows["head.kind"]
    assert "`auto`" in rows["target.dtype"] and "One of: auto, bf16, fp16, fp32." in rows["target.dtype"]


def test_cli_reference_lists_every_stage():
    from draftsmith.cli import STAGES
    text = _hooks().cli_reference()
    assert all(f"## draftsmith {stage}" in text for stage in STAGES)
    assert "--gpu-memory-gb" in text and "--allow-unvalidated" in text
