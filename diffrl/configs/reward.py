"""The reward of a run: the weighted components `reward.components` names (registered rewards, or a user's
`module:function`), checked as a config is parsed. Scoring them is diffrl/engines/reward/multi.py's MultiReward; a
user's reward is imported only when the engines are built (diffrl/engines/reward/user.py)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import ClassVar

# module:attribute, both dotted Python names (an attribute path may name a method of a module-level object)
_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_user_reward(name: str) -> bool:
    """Whether a component's name is a `module:function` (a user's reward) rather than a registered reward's name."""
    return ":" in name


def check_spec(name: str) -> None:
    """ValueError unless `name` is spelled module:function (checked without importing anything)."""
    if not _SPEC.fullmatch(name):
        raise ValueError(
            f"reward component {name!r}: a Python reward is named module:function, both dotted Python names "
            "(e.g. mypkg.rewards:brightness)"
        )


@dataclass
class RewardComponent:
    """One reward of the weighted sum; options go to the reward's own options dataclass."""

    # a step's stored rewards are this weighted sum: fixed on resume (diffrl/configs/changes.py)
    FIXED_ON_RESUME: ClassVar[dict[str, str]] = {"name": "data", "weight": "data"}

    name: str  # a registered reward, or module:function for your own Python reward (docs/rewards.md)
    weight: float = 1.0  # its weight in the sum
    required: bool = True  # a failure fails the step; false: the sample is left out of this reward's total
    options: dict = field(default_factory=dict)  # the reward's own options (a Python reward: its keyword arguments)

    def __post_init__(self):
        if not self.name:
            raise ValueError("reward component: 'name' must be a registered reward name, got ''")
        if is_user_reward(self.name):
            check_spec(self.name)  # the spelling only: its module is imported when the reward is built
        if not math.isfinite(self.weight):
            raise ValueError(f"reward component {self.name!r}: 'weight' must be finite, got {self.weight}")


@dataclass
class RewardConfig:
    """components: the weighted rewards, scored by one MultiReward on the run's reward role (diffrl/engines/step/
    memory.py streams each rollout forward batch to it)."""

    components: list[RewardComponent]

    def __post_init__(self):
        # YAML gives dicts; turn them into components here so only dataclasses travel further.
        self.components = [c if isinstance(c, RewardComponent) else RewardComponent(**c) for c in self.components]
        if not self.components:
            raise ValueError("reward config: 'components' must name at least one reward")
        names = [c.name for c in self.components]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"reward config: component names must be unique, repeated: {', '.join(duplicates)}")
