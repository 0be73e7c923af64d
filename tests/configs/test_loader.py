"""The typed config loader: nesting, coercion, dotted overrides, errors with suggestions."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import yaml

from diffrl.configs.loader import ConfigError, apply_overrides, build, to_dict


def load(cls: type, overrides: list[str] | None = None, *, text: str = "{}"):
    """YAML text plus dotted overrides into `cls`, as configs.schema.load_experiment does for a config file."""
    return build(cls, apply_overrides(yaml.safe_load(text) or {}, overrides or [], cls))


@dataclass
class Inner:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    name: str | None = None

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass
class Outer:
    steps: int = 3
    train: Inner = field(default_factory=Inner)
    tags: list[str] = field(default_factory=list)


def test_yaml_and_overrides_build_typed_tree():
    cfg = load(Outer, ["train.lr=2e-4", "train.betas=[0.5, 0.6]", "tags=[a, b]"], text="steps: 5\ntrain:\n  name: x\n")
    assert cfg.steps == 5 and cfg.train.lr == pytest.approx(2e-4) and cfg.train.betas == (0.5, 0.6)
    assert cfg.train.name == "x" and cfg.tags == ["a", "b"]
    assert to_dict(cfg) == {"steps": 5, "train": {"lr": 2e-4, "betas": [0.5, 0.6], "name": "x"}, "tags": ["a", "b"]}


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.lrr'.*did you mean 'train.lr'"):
        load(Outer, ["train.lrr=1"], text="{}")
    with pytest.raises(ConfigError, match=r"'stepz'.*did you mean 'steps'"):
        load(Outer, text="stepz: 1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train.lrr'; did you mean 'train.lr'\?"):
        load(Outer, text="train:\n  lrr: 1\n")  # a YAML file's key: the same dotted suggestion


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match=r"steps: expected an integer"):
        load(Outer, ["steps=abc"], text="{}")
    with pytest.raises(ConfigError, match=r"train: lr must be > 0"):
        load(Outer, ["train.lr=-1"], text="{}")
    with pytest.raises(ConfigError, match="section.key=value"):
        load(Outer, ["steps"], text="{}")
