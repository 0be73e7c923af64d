"""How a config differs from the one a run recorded, field by field, and which differences a resume cannot take.

Each config dataclass declares its fields that a resume cannot change in `FIXED_ON_RESUME` ({field: kind}), next to
the fields themselves: "data" fields give the run's stored rows their meaning (the sampler, the step's size and
chunks, the prompts, the reward's sum, the seed), "weights" fields also describe the trained weights (the model, the
LoRA's shape), which a run started from another one's weights (run.init_from) must match. Every other field may change
on resume and is applied whole (docs/training.md, "Changing a run's config").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import yaml

from diffrl.configs.loader import yaml_fields


@dataclass(frozen=True)
class Change:
    key: str  # dotted, as an override names it
    old: Any  # the recorded value (plain YAML data)
    new: Any
    kind: str | None  # the FIXED_ON_RESUME kind ("data", "weights"); None: the field may change

    @property
    def fixed(self) -> bool:
        return self.kind is not None

    def __str__(self) -> str:
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)}"


def _show(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("\n...").strip()


def config_changes(cfg: Any, new: dict, recorded: dict) -> list[Change]:
    """The fields where `new` (the plain form of the config dataclass `cfg`) differs from `recorded` (a run's recorded
    config), each with its FIXED_ON_RESUME kind. A field the recorded config lacks (written by a diffrl without it) is
    not compared. A dataclass whose fixed `name` changed (another algorithm, another reward) is one change: the rest
    of its fields belong to the other one."""
    return list(_changes(cfg, new, recorded, "", None))


def _fixed(node: Any) -> dict[str, str]:
    return getattr(type(node), "FIXED_ON_RESUME", {})


def _changes(node: Any, new: Any, old: Any, key: str, kind: str | None):
    if dataclasses.is_dataclass(node) and isinstance(new, dict):
        if not isinstance(old, dict):
            yield Change(key, old, new, kind)
            return
        fixed = _fixed(node)
        if "name" in fixed and "name" in old and old["name"] != new.get("name"):
            yield Change(_join(key, "name"), old["name"], new.get("name"), kind or fixed["name"])
            return
        for name, f in yaml_fields(node).items():
            if name in old and name in new:
                inner = kind or fixed.get(f.name)
                yield from _changes(getattr(node, f.name), new[name], old[name], _join(key, name), inner)
    elif _dataclass_list(node) and isinstance(new, list):
        if not isinstance(old, list) or len(old) != len(new):
            # another number of items (rewards): fixed when the items have fixed fields
            yield Change(key, old, new, kind or next((k for item in node for k in _fixed(item).values()), None))
            return
        for i, (item, n, o) in enumerate(zip(node, new, old)):
            yield from _changes(item, n, o, f"{key}[{i}]", kind)
    elif new != old:
        yield Change(key, old, new, kind)


def _dataclass_list(node: Any) -> bool:
    return isinstance(node, (list, tuple)) and bool(node) and all(dataclasses.is_dataclass(v) for v in node)


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name
