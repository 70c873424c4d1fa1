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


def test_every_head_kind_engine_and_stage_has_its_page_in_the_site():
    from draftsmith.cli import STAGES
    from draftsmith.heads.registry import known_kinds
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [f"heads/{kind}.md" for kind in known_kinds()] + [f"stages/{stage}.md" for stage in STAGES
                                                               if stage not in ("run", "init", "plan")]
    pages += ["engines/vllm.md", "engines/sglang.md", "engines/speculators.md", "troubleshooting.md", "quickstart.md",
              "guides/reasoning.md", "guides/server.md", "guides/choosing-a-head.md"]
    for page in pages:
        assert (ROOT / "docs" / page).exists() and page in nav, page
    troubleshooting = (ROOT / "docs" / "troubleshooting.md").read_text()
    for code in ("template", "layer_ids", "rope", "vocab", "dtype", "target"):  # every mismatch check looks for
        assert f"`{code}`" in troubleshooting


def test_benchmarks_page_renders_every_measured_head_with_a_plot(tmp_path):
    import json
    bench = {"date": "2026-12-07", "machine": "a CPU", "recipe": "r.yaml", "measured": {"kinds": "2026-12-07, a CPU"},
             "kinds": {"eagle3": {"tau": 3.25, "speedup_vs_plain": 1.5, "exact": "4/4", "acceptance_per_depth": [0.8, 0.6]},
                       "dflash": {"tau": 2.5, "speedup_vs_plain": 1.75, "exact": "4/4", "acceptance_per_depth": [0.7]}},
             "kinds_economics": {"eagle3": {"speedup_by_batch_size": {"1": 1.5, "16": 0.9}, "crossover_batch_size": 16}},
             "capture": {"full": {"tokens_per_s": 10.0}}}
    (tmp_path / "BENCHMARKS.json").write_text(json.dumps(bench))
    page = _hooks().benchmarks_page(tmp_path, tmp_path / "plots")
    assert "| eagle3 | 3.25 | 1.50 | 4/4 |" in page and "| dflash | 2.50 | 1.75 | 4/4 |" in page
    assert "Measured 2026-12-07, a CPU." in page and "| eagle3 | 16 | 1: 1.50x, 16: 0.90x |" in page
    assert "## capture" not in page  # no head measured there
    assert (tmp_path / "plots" / "kinds.png").stat().st_size > 1000 and (tmp_path / "plots" / "kinds_economics.png").exists()
