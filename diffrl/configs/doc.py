"""`diffrl config show --doc` and docs/configuration.md: every config key with its type, default, allowed values and
one line of meaning, read from the schema itself.

- type: the field's annotation as written; default: the schema's (the algorithm section's: the default bundle's);
- allowed: what the schema's own checks say, found by building the section with a value out of range and keeping
  the error's "must be ..." text (so the page states what `__post_init__` enforces, never a copy of it);
- meaning: the comment on the field's line, else the comment lines right above it, else the `name: ...` entry of its
  class docstring;
- fixed on resume: the field is in its class's FIXED_ON_RESUME (diffrl/configs/changes.py).

    python -m diffrl.configs.doc > docs/configuration.md     (what `diffrl config show --doc` prints)
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import re
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from typing import Any

import yaml

from diffrl.configs.loader import to_dict, yaml_fields

# values that break a check: a string no choice is, numbers below and above the usual ranges
_PROBES = {"str": ("?",), "int": (-2, 0), "float": (-1.0, 0.0, 2.0)}


@dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted, as an override names it (`reward.components[].weight` for a list's items)
    type: str
    default: str
    allowed: str
    meaning: str
    fixed: bool = False  # a resume of a run with stored data cannot change it


def key_docs() -> list[KeyDoc]:
    """Every key of an experiment config, in the order `diffrl config show` prints them."""
    from diffrl.algorithms.catalog import algorithms
    from diffrl.configs.schema import ExperimentConfig

    default = ExperimentConfig()
    docs: list[KeyDoc] = []
    for f in dataclasses.fields(ExperimentConfig):
        if f.name == "algorithm":
            docs += _algorithm_docs(algorithms(), default.algorithm.name)
        elif f.name == "reward":
            docs += _reward_docs(default.reward)
        else:
            docs += _section_docs(getattr(default, f.name), f.name)
    return docs


def _section_docs(instance: Any, prefix: str, only: set[str] | None = None, fixed: bool = False) -> list[KeyDoc]:
    """The keys of one dataclass instance (its defaults), nested sections flattened."""
    docs = []
    cls = type(instance)
    for name, f in yaml_fields(instance).items():
        value = getattr(instance, f.name)
        key = f"{prefix}.{name}"
        if only is not None and f.name not in only:
            continue
        kept = fixed or f.name in getattr(cls, "FIXED_ON_RESUME", {})
        if dataclasses.is_dataclass(value):
            docs += _section_docs(value, key, fixed=kept)
        else:
            meaning = _meaning(cls, f.name)
            docs.append(KeyDoc(key, _annotation(cls, f.name), _yaml(value), _allowed(instance, f), meaning, kept))
    return docs


def _algorithm_docs(bundles: dict[str, Any], default_name: str) -> list[KeyDoc]:
    """algorithm.name, then the fields of every bundle's class (the default bundle's values; a field some bundles lack
    says which have it)."""
    names = sorted(bundles)
    docs = [
        KeyDoc(
            "algorithm.name",
            "str",
            default_name,
            "one of " + ", ".join(names),
            "the named bundle of defaults (docs/algorithms.md); `algorithm=NAME` replaces the whole section, "
            "`algorithm.FIELD=VALUE` edits one field; a bundle's values: `diffrl config show algorithm=NAME`",
            fixed=True,
        )
    ]
    seen: dict[str, list[str]] = {}
    for name in [default_name, *names]:
        for f in dataclasses.fields(bundles[name]):
            seen.setdefault(f.name, [])
            if name not in seen[f.name]:
                seen[f.name].append(name)
    for field_name, having in seen.items():
        if field_name == "name":
            continue
        for doc in _section_docs(bundles[having[0]], "algorithm", only={field_name}):
            if len(having) < len(bundles):
                which = f"(algorithms: {', '.join(sorted(having))}"
                # not a field of the default bundle: the default shown is the first bundle's that has it
                which += ")" if having[0] == default_name else f"; default: {having[0]}'s)"
                doc = dataclasses.replace(doc, meaning=f"{doc.meaning} {which}".strip())
            docs.append(doc)
    return docs


def _reward_docs(reward: Any) -> list[KeyDoc]:
    from diffrl.configs.reward import RewardComponent

    docs = [
        KeyDoc(
            "reward.components",
            "list[RewardComponent]",
            _yaml([{"name": c.name} for c in reward.components]),
            "",
            _meaning(type(reward), "components"),
            fixed=True,  # which rewards are summed (each component's name and weight are fixed too)
        )
    ]
    item = RewardComponent(name=reward.components[0].name)
    return docs + _section_docs(item, "reward.components[]")


def _yaml(value: Any) -> str:
    text = yaml.safe_dump(to_dict(value), default_flow_style=True, sort_keys=False, width=1 << 16).strip()
    return text.removesuffix("\n...").strip()


def _annotation(cls: type, name: str) -> str:
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            tp = klass.__annotations__[name]
            return tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    return ""


def _allowed(instance: Any, f: dataclasses.Field) -> str:
    """What the class's checks say about the field: the error messages of out-of-range values, "must be" dropped."""
    kinds = [k for k in re.split(r"\s*\|\s*", _annotation(type(instance), f.name)) if k in _PROBES]
    said: list[str] = []
    for kind in kinds:
        for probe in _PROBES[kind]:
            try:
                dataclasses.replace(instance, **{f.name: probe})
            except ValueError as e:
                text = _requirement(str(e), f.name, [g.name for g in dataclasses.fields(instance)])
                if text and text not in said:
                    said.append(text)
    return "; ".join(said)


def _requirement(message: str, name: str, fields: list[str]) -> str:
    """`rollout.top_p must be in (0, 1]; got 0.0` -> `in (0, 1]`; "" when the message says no bound of `name` (a
    check across fields)."""
    found = re.search(rf"\b{re.escape(name)}\b'?:?\s*(.*)", message, re.DOTALL)
    if found is None:
        return ""
    text = re.split(r"[;,]\s*got\b|\s+got\s+\S+$", found.group(1))[0].strip().rstrip(",;")
    if not text.startswith("must") and " must " in text:  # "a, b and c must be > 0"
        text = text[text.index("must") :]
    if not re.match(r"must|[<>=]|in [(\[]", text):
        return ""
    others = "|".join(re.escape(f) for f in fields if f != name)
    text = re.split(rf"(?:,| and) (?:\w+\.)*(?:{others})\b", text)[0]  # "... and cluster.reward_gpus >= 0"
    text = text.removeprefix("must be ").removeprefix("must ")
    # ['a', 'b'] / ('a', 'b') -> a, b
    text = re.sub(r"[\[(]((?:'[^']*'(?:, )?)+)[\])]", lambda m: m.group(1).replace("'", ""), text)
    return " ".join(text.split())


def _meaning(cls: type, name: str) -> str:
    """The field's comment (its line's, else the lines right above it), else its class docstring's `name: ...`; the
    first class of the MRO that says anything."""
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        said = _comments(klass).get(name) or _docstring_entries(klass).get(name)
        if said:
            return said
    return ""


@functools.cache
def _comments(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comment_at: dict[int, str] = {}  # 1-based line -> the comment on it
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comment_at[token.start[0]] = token.string.lstrip("#").strip()
    [node] = ast.parse(source).body
    found = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        trailing = [comment_at[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if i in comment_at]
        above, line = [], stmt.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comment_at[line])
            line -= 1
        text = trailing[0] if trailing else " ".join(above)
        if text:
            found[stmt.target.id] = text
    return found


@functools.cache
def _docstring_entries(cls: type) -> dict[str, str]:
    """`name: text` and `a, b: text` entries of a class docstring (``name`` quoting allowed), for its fields."""
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    fields = {f.name for f in dataclasses.fields(cls)}
    label = r"(?:``)?(\w+)(?:``)?"
    pattern = re.compile(rf"(?:^|(?<=\. )|(?<=\n))\s*({label}(?:\s*(?:,|/|and)\s*{label})*)\s*:\s")
    starts = []
    for m in pattern.finditer(doc):
        names = re.findall(r"\w+", re.sub(r"\band\b", ",", m.group(1)))
        if names and all(n in fields for n in names):
            starts.append((m.start(), m.end(), names))
    entries: dict[str, str] = {}
    for i, (_, end, names) in enumerate(starts):
        stop = starts[i + 1][0] if i + 1 < len(starts) else len(doc)
        text = re.split(r"\n\s*\n|\n(?=[A-Z]\w*:)", doc[end:stop])[0]
        for n in names:
            entries.setdefault(n, " ".join(text.split()))
    return entries


def render_markdown(docs: list[KeyDoc]) -> str:
    """docs/configuration.md: one list item per key, grouped by section."""
    out = [
        "# Configuration reference",
        "",
        "Every key of an experiment config: its type, its default, the values the schema accepts where it checks",
        "them, and what it does. Generated from the schema (diffrl/configs/schema.py and the component configs",
        "beside it) by `diffrl config show --doc`; `diffrl config show CONFIG` prints a config's resolved values. A",
        "key is set in the YAML file's section or as a dotted override (`diffrl train CONFIG train.lr=1e-4`). The",
        "algorithm section's defaults are those of the default bundle; each bundle sets its own (docs/algorithms.md).",
        "A key marked *fixed on resume* cannot change while a run that has stored data resumes; every other key can",
        '(docs/training.md, "Changing a run\'s config").',
    ]
    section = None
    for d in docs:
        top = d.key.split(".")[0]
        if top != section:
            section = top
            out += ["", f"## {section}", ""]
        head = f"- `{d.key}` ({d.type}, default `{d.default}`"
        head += f"; allowed: {d.allowed}" if d.allowed else ""
        head += "; fixed on resume)" if d.fixed else ")"
        out.append(f"{head}: {d.meaning}" if d.meaning else head)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_markdown(key_docs()))
