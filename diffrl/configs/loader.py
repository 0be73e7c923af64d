"""YAML -> typed dataclasses, with dotted CLI overrides and suggestions for unknown keys.

A config file is one complete experiment (no composition, no interpolation). Overrides are
`section.field=value` strings; values are parsed as YAML scalars/lists (`train.lr=1e-4`,
`rollout.window.start_range=[0,5]`). Every unknown key is an error that names the closest valid key.
A field named after a Python keyword with a trailing underscore (`async_`) is the keyword in YAML (`run.async`).
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import types
import typing
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key or value a user wrote is wrong; the message says where and what is allowed."""


def _suggest(key: str, valid: list[str], section: str = "") -> str:
    """The hint for `key` mistyped in `section` (dotted; "" at the top): "; did you mean 'train.lr'? valid keys of
    train: ...", the suggestion being the whole dotted key, as the user writes it in an override."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {f'{section}.{close[0]}' if section else close[0]!r}?" if close else ""
    return f"{hint} valid keys{f' of {section}' if section else ''}: {', '.join(valid)}"


def _retired(cls: type, path: str, key: str) -> str:
    """The message of a key the schema has retired (a class's RETIRED: {key: what replaces it}), else ""."""
    replacement = getattr(cls, "RETIRED", {}).get(key)
    return f"config key {path!r} is retired: {replacement}" if replacement else ""


def yaml_key(name: str) -> str:
    """The YAML key of a dataclass field: its name, or the Python keyword a trailing underscore escapes (`async_` ->
    `async`)."""
    bare = name[:-1]
    return bare if name.endswith("_") and keyword.iskeyword(bare) else name


def yaml_fields(cls: type) -> dict[str, dataclasses.Field]:
    """{YAML key: field} of a dataclass (type or instance), in field order."""
    return {yaml_key(f.name): f for f in dataclasses.fields(cls)}


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML value to the annotated type `tp` (dataclasses, Optional, tuples, lists, dicts, scalars)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any or tp is object:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: cannot use {value!r}")
    if typing.get_origin(tp) is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not allowed; choose one of {list(args)}")
        return value
    if _is_dataclass_type(tp):
        if dataclasses.is_dataclass(value) and isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {value!r}")
        return build(tp, value, where=where)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{where}: expected {len(args)} values, got {len(value)}")
            return tuple(coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        seq = [coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(seq) if origin is tuple else seq
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def build(cls: type[T], data: dict, *, where: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown keys and bad values raise ConfigError with the path."""
    if data is None:
        data = {}
    hints = typing.get_type_hints(cls)
    fields = {key: f for key, f in yaml_fields(cls).items() if f.init}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            unknown = f"unknown config key {path!r}{_suggest(str(key), list(fields), where)}"
            raise ConfigError(_retired(cls, path, str(key)) or unknown)
        name = fields[key].name
        kwargs[name] = coerce(value, hints[name], path)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}{e}") from None


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain YAML-able data (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {key: to_dict(getattr(obj, f.name)) for key, f in yaml_fields(obj).items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        return key.split("."), yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({yaml_problem(e)})") from None


def yaml_problem(error: Exception) -> str:
    """A YAML error in one line: "expected ',' or ']', but got '<stream end>' (line 1, column 4)"."""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def apply_overrides(data: dict, overrides: list[str], cls: type) -> dict:
    """Set dotted keys in a raw mapping, checking each path against the dataclass tree of `cls`."""
    for text in overrides:
        path, value = parse_override(text)
        node, tp = data, cls
        for depth, part in enumerate(path):
            where = ".".join(path[: depth + 1])
            names = list(yaml_fields(tp)) if _is_dataclass_type(tp) else None
            if names is not None and part not in names:
                unknown = f"unknown config key {where!r}{_suggest(part, names, '.'.join(path[:depth]))}"
                raise ConfigError(_retired(tp, where, part) or unknown)
            if depth == len(path) - 1:
                node[part] = value
                break
            tp = _field_type(tp, part)
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"{where!r} is a value, not a section")
            node = child
    return data


def _field_type(cls: type, key: str) -> Any:
    tp = typing.get_type_hints(cls)[yaml_fields(cls)[key].name]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
    return tp
