"""A user's own Python reward, named in the config as `module:function` (docs/rewards.md):

    reward:
      components:
        - name: mypkg.rewards:brightness   # import mypkg.rewards, call its `brightness`
          options: {target: 128}           # passed to it as keyword arguments

The function is called on a batch as `function(images, prompts, metadata, **options)`:
- images: uint8 numpy (B, H, W, 3), videos (B, F, H, W, 3); an autoregressive run's decoded responses: a list of B str;
- prompts: a list of B str; metadata: a list of B dicts (`ground_truth` and the prompt file's other fields);
- it returns one score per sample: a list, a 1-D numpy array or a tensor of B numbers. None (or NaN) marks a sample
  it could not score: that sample is excluded (diffrl/engines/reward/multi.py), never counted as 0.

The module is imported where the reward runs (the training process, each Ray engine replica, a spawned process that
unpickles the reward), only when the engines are built from the config the user passed: parsing a config never
imports anything, so a config recorded in a run folder cannot run code by being read.
"""

from __future__ import annotations

import difflib
import importlib
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from diffrl.configs.reward import check_spec
from diffrl.engines.reward.base import RewardOutput, to_samples


def load_function(spec: str) -> Callable:
    """The callable `spec` (module:function) names, imported now; ValueError in one line when the module cannot be
    imported, lacks the attribute, or the attribute is not a function."""
    check_spec(spec)
    module_name, _, path = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(
                f"reward {spec!r}: no module named {e.name!r} here; it must be importable where the reward runs "
                "(an installed package, or its folder on PYTHONPATH: docs/rewards.md)"
            ) from None
        raise ValueError(f"reward {spec!r}: importing {module_name!r} failed: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing: say so in one line
        raise ValueError(f"reward {spec!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    where = module_name
    for part in path.split("."):
        if not hasattr(obj, part):
            public = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, public, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"reward {spec!r}: {where!r} has no attribute {part!r}{hint}")
        obj, where = getattr(obj, part), f"{where}.{part}"
    if isinstance(obj, type) or not callable(obj):
        what = "a class" if isinstance(obj, type) else f"a {type(obj).__name__}"
        raise ValueError(
            f"reward {spec!r} is {what}, not a function: name a function "
            "f(images, prompts, metadata, **options) -> one score per sample"
        )
    return obj


@dataclass
class UserReward:
    """A RewardFunction around the user's callable; it gets the whole batch it is given (it batches inside, if its
    model needs to). Pickles by reference to the function: a spawned process imports the module again."""

    name: str
    function: Callable
    options: dict = field(default_factory=dict)
    batch_size: int = sys.maxsize

    def __call__(self, images, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        samples = to_samples(images)
        returned = self.function(samples, list(prompts), list(metadata), **self.options)
        return RewardOutput.from_lists(scores_of(returned, len(prompts), self.name))


def scores_of(returned: Any, count: int, name: str) -> list[float | None]:
    """What a user's reward returned as `count` scores (None: excluded); TypeError/ValueError in one line naming
    the reward when it is not one number (or None) per sample."""
    if isinstance(returned, torch.Tensor):
        returned = returned.detach().cpu().numpy()
    if isinstance(returned, np.ndarray) and returned.ndim != 1:
        raise ValueError(f"reward {name!r} returned an array of shape {returned.shape}: one score per sample is 1-D")
    if not isinstance(returned, (list, tuple, np.ndarray)):
        raise TypeError(
            f"reward {name!r} returned a {type(returned).__name__}: it must return one score per sample "
            "(a list, 1-D numpy array or tensor)"
        )
    if len(returned) != count:
        raise ValueError(f"reward {name!r} returned {len(returned)} scores for {count} samples: one per sample")
    scores: list[float | None] = []
    for index, value in enumerate(returned):
        if value is None:
            scores.append(None)  # could not score it: excluded, as the built-in rewards do
        elif isinstance(value, (bool, int, float, np.number)):
            scores.append(None if math.isnan(float(value)) else float(value))
        else:
            raise TypeError(f"reward {name!r} returned a {type(value).__name__} for sample {index}: scores are numbers")
    return scores


def user_reward(spec: str, options: dict) -> UserReward:
    """The reward `spec` (module:function) with its options as keyword arguments, imported now (start-up)."""
    if not isinstance(options, dict):
        raise ValueError(f"options of reward {spec!r} must be a mapping, got {type(options).__name__}")
    return UserReward(name=spec, function=load_function(spec), options=dict(options))
