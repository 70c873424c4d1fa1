"""mkdocs hook: the recipe reference and the CLI reference are generated at every build, from `recipe.py`
(every key, its type, default, the head kinds that read it, its doc line) and from the CLI's own parser, so
they can never drift from the code."""
from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

HEAD_KINDS = ("eagle3", "eagle2", "medusa", "mtp", "dflash", "peagle")


def _field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class, field) -> the comment on the field's line, with the comment lines that continue it."""
    comments, cls, last, above = {}, None, None, []
    for line in source.splitlines():
        match = re.match(r"^class (\w+)", line)
        if match:
            cls, last, above = match.group(1), None, []
            continue
        field = re.match(r"^    (\w+): [^=]+(=.*)?$", line)
        found = re.search(r"\s#\s?(.*)$", line)  # no field's default holds a '#'
        comment = found.group(1).strip() if found else ""
        if field and cls:
            last = (cls, field.group(1))
            comments[last] = comment or " ".join(above)  # inline, else the comment lines just above it
            above = []
        elif re.match(r"^    #", line):  # a comment at the fields' indent: about the next field
            above.append(comment)
        elif last and re.match(r"^\s{8,}#", line):  # an aligned comment line continuing the field's own
            comments[last] = (comments[last] + " " + comment).strip()
        else:
            last, above = None, []
    return comments


def _type_name(tp) -> str:
    text = str(tp) if typing.get_origin(tp) else getattr(tp, "__name__", str(tp))
    text = text.replace("typing.", "").replace("draftsmith.recipe.", "").replace("NoneType", "None")
    return text.replace(" | ", " or ")


def _kinds(comment: str) -> str:
    """The head kinds a comment names before its first colon (`eagle3, peagle: ...`), else every kind."""
    head = comment.split(":", 1)[0] if ":" in comment else ""
    named = [k for k in HEAD_KINDS if re.search(rf"\b{k}\b", head)]
    return ", ".join(named) if named else "all"


def recipe_reference() -> str:
    from draftsmith import recipe
    comments = _field_comments(Path(recipe.__file__).read_text())
    lines = ["# Recipe reference", "",
             "Generated from `draftsmith/recipe.py` at every docs build. Every key can be overridden on the command "
             "line as `section.key=value` (the value is read as YAML); an unknown key or a wrong type stops the load "
             "naming the key path.", ""]

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        rows, nested = [], []
        for f in dataclasses.fields(cls):
            if f.name == "source_path":
                continue
            tp, path = hints[f.name], f"{prefix}{f.name}"
            inner = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
            if inner and not typing.get_origin(tp) is list:
                nested.append((inner[0], f"{path}."))
            default = f.default if f.default is not dataclasses.MISSING else (
                "(section)" if inner else repr(f.default_factory()) if f.default_factory is not dataclasses.MISSING else "required")
            choices = recipe.CHOICES.get(path.replace("[]", ""))
            doc = comments.get((cls.__name__, f.name), "")
            if choices:
                doc = (doc + f" One of: {', '.join(sorted(choices))}.").strip()
            kinds = _kinds(doc) if prefix == "head." else ""
            rows.append(f"| `{path}` | `{_type_name(tp)}` | `{default}` |" + (f" {kinds} |" if prefix == "head." else "")
                        + f" {doc.replace('|', '/')} |")
        title = prefix.rstrip(".") or "top level"
        lines.extend([f"## {title}", "", (cls.__doc__ or "").strip().replace("\n", " "), "",
                      "| key | type | default |" + (" read by |" if prefix == "head." else "") + " what it does |",
                      "|---|---|---|" + ("---|" if prefix == "head." else "") + "---|", *rows, ""])
        for sub, sub_prefix in nested:
            walk(sub, sub_prefix)
    walk(recipe.Recipe, "")
    return "\n".join(lines)


def cli_reference() -> str:
    from draftsmith import cli
    parser = cli._parser()
    lines = ["# CLI reference", "", "Generated from the CLI's own parser at every docs build.", "",
             "```", parser.format_help().rstrip(), "```", ""]
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub_parser in sub.choices.items():
        lines += [f"## draftsmith {name}", "", "```", sub_parser.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


def _head_rows(section: dict) -> dict:
    """The entries of a bench section that are measured heads (they have a tau)."""
    return {name: row for name, row in section.items() if isinstance(row, dict) and "tau" in row}


def _plot_section(name: str, rows: dict, out: Path) -> str:
    """Acceptance by depth and tau of each head of a section, one PNG; its file name."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    for head, row in rows.items():
        alphas = row.get("acceptance_per_depth") or []
        left.plot(range(1, len(alphas) + 1), alphas, marker="o", label=head)
    left.set(title="acceptance by depth", xlabel="depth", ylabel="conditional acceptance", ylim=(0, 1.02))
    left.legend(fontsize=7)
    right.barh(list(rows), [row["tau"] for row in rows.values()])
    right.set(title="tau (tokens per target forward)")
    fig.tight_layout()
    file = f"{name}.png"
    fig.savefig(out / file, dpi=80)
    plt.close(fig)
    return file


def _economics_section(name: str, section: dict, measured: dict, out: Path) -> list[str]:
    """Speedup over plain decoding by batch size, each drafter at its best K there; the crossover."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2))
    lines = [f"## {name}", "", f"Measured {measured.get(name, '')}. Speedup over plain decoding at each batch size, "
             "each drafter at its best K there.", "", "| drafter | crossover batch size | speedup by batch size |", "|---|---|---|"]
    for drafter, row in section.items():
        speedups = {int(b): v for b, v in row["speedup_by_batch_size"].items()}
        ax.plot(list(speedups), list(speedups.values()), marker="o", label=drafter)
        lines.append(f"| {drafter} | {row.get('crossover_batch_size') or 'none'} | "
                     + ", ".join(f"{b}: {v:.2f}x" for b, v in speedups.items()) + " |")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="batch size", ylabel="speedup vs plain")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=80)
    plt.close(fig)
    return lines + ["", f"![{name}](benchmarks/{name}.png)", ""]


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return format(value, fmt) if isinstance(value, (int, float)) else str(value if value is not None else "")


def benchmarks_page(root: Path, out: Path) -> str:
    """docs/benchmarks.md from BENCHMARKS.json: per section of measured heads a table and a plot; BENCHMARKS.md
    (written by `make bench`) keeps the full text."""
    import json
    bench = json.loads((root / "BENCHMARKS.json").read_text())
    measured = bench.get("measured", {})
    lines = ["# Benchmarks", "", f"Rendered from `BENCHMARKS.json` at every docs build. `make bench` measures and writes "
             f"it, with the full tables and notes in `BENCHMARKS.md` at the repository root. Latest run: {bench.get('date')} on {bench.get('machine')}; recipe `{bench.get('recipe')}`.", "",
             "CPU figures depend on the CPU: the embedded target trains differently under different kernels, so each "
             "section names the machine that measured it.", ""]
    out.mkdir(parents=True, exist_ok=True)
    for name, section in bench.items():
        if isinstance(section, dict) and any(isinstance(r, dict) and "speedup_by_batch_size" in r for r in section.values()):
            lines += _economics_section(name, section, measured, out)
            continue
        rows = _head_rows(section) if isinstance(section, dict) else {}
        if not rows or name == "runtime":
            continue
        when = measured.get(name) if isinstance(measured.get(name), str) else f"{bench.get('date')}, {bench.get('machine')}"
        lines += [f"## {name}", "", f"Measured {when}.", "",
                  "| head | tau | speedup vs plain | exact | train steps | train s |", "|---|---|---|---|---|---|"]
        lines += [f"| {head} | {_cell(row, 'tau', '.2f')} | {_cell(row, 'speedup_vs_plain', '.2f')} | "
                  f"{row.get('exact', row.get('num_exact', ''))} | {_cell(row, 'train_steps', 'd')} | "
                  f"{_cell(row, 'train_seconds', '.0f')} |" for head, row in rows.items()]
        lines += ["", f"![{name}](benchmarks/{_plot_section(name, rows, out)})", ""]
    return "\n".join(lines)


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:  # unchanged files are left alone (no rebuild loop)
        path.write_text(text)


def on_pre_build(config, **kwargs) -> None:
    docs = Path(config["docs_dir"])
    out = docs / "reference"
    out.mkdir(exist_ok=True)
    for name, text in (("recipe.md", recipe_reference()), ("cli.md", cli_reference())):
        _write_if_changed(out / name, text)
    _write_if_changed(docs / "benchmarks.md", benchmarks_page(docs.resolve().parent, docs / "benchmarks"))
