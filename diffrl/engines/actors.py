"""The names of a run's Ray actors (its engine replicas and its commit lock, in the "diffrl" namespace) and the CPU
threads each engine replica uses."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffrl.configs.schema import ExperimentConfig

NAMESPACE = "diffrl"


def actor_name(run_name: str, actor: str) -> str:
    return f"{run_name}/{actor}"


def actor_names(config: ExperimentConfig) -> list[str]:
    """The engine replicas of a run, rank order: "engine", then "engine-1" ... with cluster.gpus > 1."""
    return ["engine"] + [f"engine-{rank}" for rank in range(1, config.cluster.data_parallel)]


def actor_threads(config: ExperimentConfig, node_cpus: float) -> int:
    """CPU threads torch uses in one of the run's actors: cluster.actor_threads, or with "auto" the CPUs Ray counts
    on the actor's node shared by the run's actors (at least 1). Without it an actor keeps the one thread Ray gives
    every worker (OMP_NUM_THREADS=1) while local mode uses every core."""
    wanted = config.cluster.actor_threads
    if wanted != "auto":
        return int(wanted)
    return max(1, int(node_cpus) // len(actor_names(config)))
