"""The package's layers (STYLE.md), enforced from the imports themselves, function-level ones too:
(1) recipe, artifacts; (2) targets/; (3) data/ and heads/, which do not import each other; (4) train/
and runtime/, which do not import each other; (5) stages, cli, bench. A module imports only from
lower layers (or its own package); a heads/<kind> never imports another kind."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "draftsmith"
LAYERS = {"typed_yaml": 1, "recipe": 1, "artifacts": 1, "targets": 2, "data": 3, "heads": 3, "train": 4, "runtime": 4,
          "stages": 5, "cli": 5, "plan": 5, "scaffold": 5, "bench": 5}
KINDS = {p.name for p in (PACKAGE / "heads").iterdir() if (p / "__init__.py").exists()}  # heads/<kind>/ packages;
# the modules directly in heads/ (registry, drafting, tree, family, ttt, ...) are shared by every kind


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative: resolve against this module's package
                base = ".".join(module.split(".")[:-node.level] + [node.module])
            found += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return [name for name in found if name.split(".")[0] == "draftsmith"]


def violation(importer: str, imported: str) -> str | None:
    """Why `importer` may not import `imported`, or None when the layers allow it."""
    src, dst = importer.split("."), imported.split(".")
    if len(dst) < 2 or dst[1] not in LAYERS or src[1] == dst[1] and src[1] != "heads":
        return None
    src_layer, dst_layer = LAYERS[src[1]], LAYERS[dst[1]]
    if dst_layer > src_layer:
        return f"{importer} (layer {src_layer}) imports {imported} (layer {dst_layer}): upward"
    if dst_layer == src_layer in (3, 4) and src[1] != dst[1]:
        return f"{importer} imports {imported}: {src[1]}/ and {dst[1]}/ are peers and do not import each other"
    if src[1] == dst[1] == "heads" and len(src) > 2 and len(dst) > 2 and dst[2] in KINDS:
        if src[2] not in KINDS:
            return f"{importer} imports {imported}: shared heads/ modules never import a kind"
        if src[2] != dst[2]:
            return f"{importer} imports {imported}: a head kind never imports another kind"
    return None


def all_violations() -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        for imported in imports_of(path.read_text(), module):
            if (why := violation(module, imported)) is not None:
                problems.append(f"{path.relative_to(PACKAGE.parent)}: {why}")
    return problems


def test_no_module_imports_upward_or_sideways():
    assert all_violations() == []


@pytest.mark.parametrize("importer, imported, ok", [
    ("draftsmith.targets.loading", "draftsmith.data.capture", False),      # upward
    ("draftsmith.data.capture", "draftsmith.heads.registry", False),      # peers
    ("draftsmith.runtime.validate", "draftsmith.train.trainer", False),   # peers
    ("draftsmith.heads.eagle2.model", "draftsmith.heads.eagle3.loss", False),
    ("draftsmith.heads.eagle3.draft", "draftsmith.runtime.compile", False),
    ("draftsmith.heads.eagle3.model", "draftsmith.train.trainer", False),
    ("draftsmith.heads.eagle3.draft", "draftsmith.heads.drafting", True),
    ("draftsmith.heads.drafting", "draftsmith.heads.eagle3.model", False),
    ("draftsmith.heads.eagle3", "draftsmith.heads.eagle3.formats", True),
    ("draftsmith.runtime.validate", "draftsmith.heads.registry", True),
    ("draftsmith.train.run", "draftsmith.data.capture", True),
    ("draftsmith.stages", "draftsmith.runtime.validate", True),
    ("draftsmith.recipe", "draftsmith.artifacts", True),
    ("draftsmith.runtime.loading", "draftsmith.bench.common", False),
    ("draftsmith.bench.long_context", "draftsmith.train.batches", True),
    ("draftsmith.heads.objective", "draftsmith.train.batches", False),
])
def test_the_rule_itself(importer, imported, ok):
    assert (violation(importer, imported) is None) == ok


def test_function_level_and_relative_imports_are_seen():
    source = "def f():\n    from draftsmith.train.trainer import Trainer\nfrom .capture import x\n"
    assert sorted(imports_of(source, "draftsmith.data.store")) == [
        "draftsmith.data.capture", "draftsmith.data.capture.x", "draftsmith.train.trainer", "draftsmith.train.trainer.Trainer"]


# Directory names that GitHub's Python .gitignore template ignores (PyBuilder's target/, distribution and
# packaging folders, virtual environments): a fork made with that template would silently lose such a package.
PYTHON_GITIGNORE_DIRS = {"target", "build", "dist", "develop-eggs", "downloads", "eggs", ".eggs", "lib", "lib64",
                         "parts", "sdist", "var", "wheels", "env", "venv", ".venv", "ENV", "htmlcov", "site"}


def test_no_package_folder_is_ignored_by_the_python_gitignore_template():
    folders = {p.name for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"} | {PACKAGE.name}
    assert not folders & PYTHON_GITIGNORE_DIRS


def import_graph() -> dict[str, set[str]]:
    """module -> the draftsmith modules it imports (names that are functions or classes dropped)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {module: {name for name in imports_of(path.read_text(), module) if name in paths and name != module}
            for module, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles, each as the path that closes it (packages importing their own __init__ excluded)."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_a_circle_is_seen():
    assert cycles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}}) == [["a.x", "a.y", "a.z", "a.x"]]


def test_economics_and_the_benches_reach_validation_only_for_run_validate():
    """Loading a target with its head, prompts and EOS set is runtime/loading.py; validate.py is validation."""
    assert "draftsmith.runtime.validate" not in import_graph()["draftsmith.runtime.sweep"]
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "draftsmith.runtime.validate":
                names = {alias.name for alias in node.names}
                assert names <= {"run_validate", "validate_dir", "validation_is_current"}, f"{path}: {names}"
