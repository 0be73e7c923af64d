"""What the flow and the stage functions are handed.

`Engines` is the warm state of one run where it lives (the flow's process, or one Ray engine replica): a stage function
is called as `fn(engines, *args)` there and reads the parts it uses. `EngineHandle` is what the flow holds to run
stage functions where the engines live: the `Engines` themselves in one process, or diffrl/engines/cluster.py's
`RayEngines` for the run's Ray replicas. Warm engines serve a later flow run only for a `comparable` config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:  # annotations only: this module stays importable without the model stack
    from diffrl.configs.schema import ExperimentConfig
    from diffrl.engines.reward.multi import MultiReward
    from diffrl.engines.rollout.engine import RolloutEngine
    from diffrl.engines.step.memory import StepMemory
    from diffrl.engines.store.image_dataset import ImageDataset
    from diffrl.engines.store.preference import PreferenceCache
    from diffrl.engines.store.prompts import PromptRecord, PromptSampler
    from diffrl.engines.store.trajectories import TrajectoryStore
    from diffrl.engines.train.trainer import PolicyTrainer
    from diffrl.models.base import ModelAdapter


@dataclass
class Engines:
    """The warm state of one run (or of one Ray replica): each stage function reads the fields it uses.

    A field is None where the run has no such part (engines built without a store for the benchmarks have no
    store). `run_uid` keys the run's Prefect task caches (set by the train flow); `model_path` is the resolved model
    folder; `preferences` is offline DPO's pair cache; `dataset` SFT's (prompt, image) rows;
    `validation_before_training` is what `diffrl train` sampled and scored on the validation prompts while Prefect's
    server booted (the train flow takes it once).
    """

    config: ExperimentConfig
    adapter: ModelAdapter | None
    rollout: RolloutEngine | None
    trainer: PolicyTrainer | None
    reward: MultiReward | None
    store: TrajectoryStore | None
    prompts: PromptSampler | None
    val_prompts: list[PromptRecord] = field(default_factory=list)
    memory: StepMemory | None = None  # the step in flight and the background writer (one process only)
    model_path: str = ""
    run_uid: str = ""
    preferences: PreferenceCache | None = None
    dataset: ImageDataset | None = None
    validation_before_training: tuple | None = None  # (samples, metrics, per-sample rewards)

    def run(self, role: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(engines, *args)` here (every role lives in this process)."""
        return fn(self, *args)

    def run_one(self, role: str, index: int, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(engines, *args)` here: this process is the only replica of every role."""
        return fn(self, *args)

    def set_run_uid(self, uid: str) -> None:
        """Key this run's task caches by `uid` (the tasks run in this process)."""
        self.run_uid = uid

    @property
    def policy_version(self) -> int:
        """The policy version the rollout samples with (the trainer's)."""
        return self.trainer.policy_version if self.trainer is not None else 0


class EngineHandle(Protocol):
    """What the flow holds of a run's engines: `run(role, fn, *args)` calls `fn(engines, *args)` where the role lives
    (every replica at once for "trainer", else the first; rank 0's result), `run_one` on replica `index` only. The
    attributes are the driver's copies: the config, the run uid, the trajectory store (resume checks), the validation
    prompts, and the step memory where it lives in this process (None for Ray replicas)."""

    config: ExperimentConfig
    run_uid: str
    store: TrajectoryStore | None
    val_prompts: list[PromptRecord]
    memory: StepMemory | None

    def run(self, role: str, fn: Callable[..., Any], *args: Any) -> Any: ...

    def run_one(self, role: str, index: int, fn: Callable[..., Any], *args: Any) -> Any: ...

    def set_run_uid(self, uid: str) -> None: ...


def comparable(config: ExperimentConfig) -> ExperimentConfig:
    """The config minus what may change between flow runs of one run name (length, logging, timeouts)."""
    run = dataclasses.replace(
        config.run, steps=1, validate_every=0, log_images=0, checkpoint_every=1, keep_latents_steps=0
    )
    cluster = dataclasses.replace(config.cluster, actor_timeout_s=1.0, actor_threads="auto")
    return dataclasses.replace(config, run=run, cluster=cluster)


def config_changes(old: ExperimentConfig, new: ExperimentConfig) -> str:
    """What differs between two configs of warm engines, by section ("cluster.gpus 2 -> 1", "model, train")."""
    a, b = comparable(old), comparable(new)
    changed = [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
    if old.cluster.gpus != new.cluster.gpus:
        changed = [f"cluster.gpus {old.cluster.gpus} -> {new.cluster.gpus}"] + [c for c in changed if c != "cluster"]
    return ", ".join(changed) or "nothing"
