"""Typed YAML: a mapping checked against a tree of dataclasses (the recipe schema), with errors naming the key
path, and dotted `section.field=value` overrides. Imports nothing of draftsmith's own."""
from __future__ import annotations

import dataclasses
import types
import typing

import yaml


class RecipeError(ValueError):
    """A recipe file or override that does not fit the schema."""


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value, tp, path: str, choices: dict):
    """Check `value` against annotation `tp`, building nested dataclasses; raise naming `path`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, path, choices)
            except RecipeError as exc:  # the error of the alternative of the value's own shape says the most
                errors.insert(0 if isinstance(value, typing.get_origin(arg) or arg) else len(errors), str(exc))
        raise RecipeError(errors[0])
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{path}: expected a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(item, item_tp, f"{path}[{i}]", choices) for i, item in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise RecipeError(f"{path or 'recipe'}: expected a mapping for {tp.__name__}, got {value!r}")
        return build(tp, value, path, choices)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp is bool and not isinstance(value, bool):
        raise RecipeError(f"{path}: expected bool (true/false), got {value!r}")
    if tp in (int, float) and isinstance(value, bool):
        raise RecipeError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    if not isinstance(value, tp):
        raise RecipeError(f"{path}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return value


def build(cls, raw: dict, prefix: str, choices: dict):
    """The dataclass `cls` from a mapping: unknown keys, wrong types and values outside `choices` (dotted path ->
    allowed values) are errors naming the key path."""
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls) if f.name != "source_path"]
    kwargs = {}
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in valid:
            raise RecipeError(f"unknown key {path!r}; valid keys here: {', '.join(valid)}")
        kwargs[key] = _coerce(value, hints[key], path, choices)
        _check_choice(path, kwargs[key], choices)
    return cls(**kwargs)


def _check_choice(path: str, value, choices: dict) -> None:
    generic = ".".join(part.split("[")[0] for part in path.split("."))
    allowed = choices.get(generic)
    values = value if isinstance(value, list) else [value]
    for item in values:
        if allowed is not None and not dataclasses.is_dataclass(item) and item not in allowed:
            raise RecipeError(f"{path}: {item!r} is not one of {sorted(allowed)}")
        if dataclasses.is_dataclass(item):
            for f in dataclasses.fields(item):
                _check_choice(f"{path}.{f.name}", getattr(item, f.name), choices)


def apply_override(raw: dict, override: str) -> None:
    """`section.field=value` (the value parsed as YAML) into the raw mapping."""
    if "=" not in override:
        raise RecipeError(f"override {override!r}: expected section.field=value")
    key, text = override.split("=", 1)
    value = yaml.safe_load(text) if text != "" else None
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"override {override!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value
