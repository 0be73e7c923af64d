"""Where the engines of a run live. Embedded default: in-process objects in this registry, found by
run name, so a Prefect task only carries (run, step, chunk) and calls the warm engine it finds here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

_LOCK = threading.Lock()
_ENGINES: dict[str, "Engines"] = {}


@dataclass
class Engines:
    """The warm state of one run: model, rollout, trainer, reward, store, prompt sampling, config."""

    config: Any                 # configs.schema.ExperimentConfig
    adapter: Any                # models.base.ModelAdapter
    rollout: Any                # engines.rollout.engine.RolloutEngine
    trainer: Any                # engines.train.trainer.PolicyTrainer
    reward: Any                 # engines.reward.multi.MultiReward
    store: Any                  # engines.store.trajectories.TrajectoryStore
    prompts: Any                # engines.store.prompts.PromptSampler
    val_prompts: list = field(default_factory=list)  # fixed PromptRecords for validation
    extras: dict = field(default_factory=dict)


def put(run_name: str, engines: Engines) -> None:
    """Register the engines of a run in this process (replacing any previous ones)."""
    with _LOCK:
        _ENGINES[run_name] = engines


def get(run_name: str) -> Engines:
    """The engines of a run; a clear error when the run's engines were never built in this process."""
    with _LOCK:
        if run_name not in _ENGINES:
            raise RuntimeError(f"no engines for run {run_name!r} in this process: run it with `diffrl train` "
                               f"(known runs here: {sorted(_ENGINES)})")
        return _ENGINES[run_name]


def drop(run_name: str) -> None:
    with _LOCK:
        _ENGINES.pop(run_name, None)
