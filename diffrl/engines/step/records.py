"""The typed results of the stages of one RL step (what a Prefect task persists, what a benchmark reads).

Each is a small frozen dataclass of numbers: tensors never leave the engines (docs/concepts.md). A Prefect
task stores `as_record(result)` (plain JSON); the flow turns it back with `from_record(Type, data)`, so a
result file in a run folder is data, never code to import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

R = TypeVar("R")


@dataclass(frozen=True)
class Generated:
    """One generate chunk: `rows` samples in `seconds` of rollout (`waited`: the stage's own wait for a rollout
    that ran ahead, prefetched behind the previous step); `reused`: found committed, not sampled again."""

    step: int
    chunk: int
    rows: int
    seconds: float
    waited: float
    reused: bool


@dataclass(frozen=True)
class Scored:
    """Rewards of one chunk: `seconds` of scoring (streamed sub-batches included), `excluded` samples; `image_stats`:
    the sums over its images of the hacking guard's statistics (diffrl/engines/reward/image_stats.py), {} when not
    measured."""

    step: int
    chunk: int
    rows: int
    seconds: float
    excluded: int
    image_stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Advantaged:
    """Group advantages of a step: critic/rewards/*, critic/advantages/* and reward/<component> metrics."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Updated:
    """The policy update of a step: actor/* metrics and timings; `rows` samples trained on."""

    step: int
    rows: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Synced:
    """The weight sync after a step's update: timing_s/sync_weights, sync/*; `prefetched`: chunks of the next
    step whose rollout started right after it."""

    step: int
    prefetched: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult:
    """A whole RL step: its metrics under verl's and flow_grpo's names."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)


def as_record(result: Any) -> dict:
    """A stage result as plain JSON-able data."""
    return dataclasses.asdict(result)


def from_record(kind: type[R], data: dict) -> R:
    """The stage result of type `kind` from `as_record`'s data (unknown keys are an error)."""
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{kind.__name__} record has unknown fields {unknown}: written by another diffrl version?")
    return kind(**data)
