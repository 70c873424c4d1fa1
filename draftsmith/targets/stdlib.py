"""The embedded default's corpus: the Python standard library's own source, split by module."""
from __future__ import annotations

import ast
import hashlib
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

SKIP_PARTS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo",
              "encodings", "pydoc_data", "ensurepip"}  # codec tables and text blobs are not code


@dataclass(frozen=True)
class Module:
    name: str
    path: Path


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_modules() -> list[Module]:
    """All stdlib .py files outside test suites, sorted so every machine sees the same order."""
    root = stdlib_root()
    modules = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS & set(rel.parts):
            continue
        modules.append(Module(".".join(rel.with_suffix("").parts), path))
    return modules


def is_heldout(module_name: str, fraction: float) -> bool:
    """Deterministic split by module, so held-out code was never seen in any form."""
    bucket = int(hashlib.sha256(module_name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return bucket < fraction


def read_source(module: Module) -> str:
    try:
        return module.path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def _functions(module: Module):
    """Yield (node, dedented source) for every function and method of a module, in `ast.walk` order."""
    source = read_source(module)
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, textwrap.dedent("\n".join(lines[node.lineno - 1 - len(node.decorator_list):node.end_lineno]))


def function_stubs(module: Module, max_chars: int = 1600) -> list[str]:
    """The documented functions of `function_conversations` as HumanEval's prompts are: the source from `def` through
    the whole docstring, no body (dedented, decorators dropped)."""
    stubs = []
    for node, body in _functions(module):
        doc = ast.get_docstring(node)
        if not doc or node.name.startswith("__") or not 80 <= len(body) <= max_chars:
            continue
        decorators = len(node.decorator_list)  # `_functions` starts the source at the first decorator's line
        lines = body.splitlines()
        stubs.append("\n".join(lines[decorators:node.body[0].end_lineno - node.lineno + decorators + 1]))
    return stubs


def function_sources(module: Module, max_chars: int = 2400) -> list[str]:
    """Every top-level or method function's source, dedented: the unit the demo is about."""
    return [body + "\n" for _, body in _functions(module) if 40 <= len(body) <= max_chars]


def function_conversations(module: Module, max_chars: int = 1600) -> list[dict]:
    """One conversation per documented function: the user gives signature and docstring,
    the assistant answers with the function's source."""
    conversations = []
    for node, body in _functions(module):
        doc = ast.get_docstring(node)
        if not doc or node.name.startswith("__") or not 80 <= len(body) <= max_chars:
            continue
        header = body[body.index("def "):].split(":\n", 1)[0] if "def " in body else body.splitlines()[0]
        signature = " ".join(header.split())  # a multi-line signature on one line
        prompt = (f"Write the function `{node.name}` from the Python module `{module.name}`.\n"
                  f"Signature: {signature}\nDocstring: {doc.strip().splitlines()[0]}")
        conversations.append({
            "id": f"{module.name}:{node.name}:{node.lineno}",
            "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": body}],
        })
    return conversations
