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


def on_pre_build(config, **kwargs) -> None:
    out = Path(config["docs_dir"]) / "reference"
    out.mkdir(exist_ok=True)
    for name, text in (("recipe.md", recipe_reference()), ("cli.md", cli_reference())):
        path = out / name
        if not path.exists() or path.read_text() != text:  # unchanged files are left alone (no rebuild loop)
            path.write_text(text)
