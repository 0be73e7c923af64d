"""What every stage task shares: its cache key is (run incarnation, step, stage, chunk), so a retried or
resumed flow run finds a completed stage Cached instead of running it again, and results are small
JSON records persisted with the run; and how a flow runs a task (in this process, or on Ray)."""

from __future__ import annotations

import os
from typing import Any, Callable

from diffrl.engines import cluster


def stage_key(run_name: str, uid: str, step: int, stage: str, chunk: int = 0) -> str:
    """The cache key (and persisted result file name) of one stage of one step."""
    return f"diffrl-{run_name}-{uid}-step{step}-{stage}-{chunk}"


def stage_cache_key(stage: str) -> Callable[[Any, dict], str]:
    """Prefect cache_key_fn for a stage: same run, step and chunk -> the same key."""

    def key(_context: Any, params: dict) -> str:
        run_name = params["run_name"]
        uid = cluster.get(run_name).extras.get("run_uid", "")
        return stage_key(run_name, uid, params["step"], stage, params.get("chunk", 0))

    return key


# Keyword arguments every stage task shares (persisted JSON results -> Cached on retry/resume).
STAGE = dict(persist_result=True, result_serializer="json", retries=0)


def step_runner(cfg: Any) -> dict:
    """rl_step options for the run's cluster mode: ray -> prefect-ray's RayTaskRunner on the run's cluster."""
    if cfg.cluster.mode != "ray":
        return {}
    from prefect_ray import RayTaskRunner

    return {
        "task_runner": RayTaskRunner(
            address=cfg.cluster.address or os.environ.get("RAY_ADDRESS") or "auto",
            init_kwargs={"runtime_env": {"env_vars": cluster.forwarded_env()}},
        )
    }


def _ray_options(cfg: Any):
    # a stage task on Ray is a thin caller of the run's actors: a slice of a CPU, no GPU, and the
    # driver's Prefect server/logging settings (whoever started Ray, the task reports to our server)
    from prefect_ray.context import remote_options

    return remote_options(num_cpus=0.5, num_gpus=0, runtime_env={"env_vars": cluster.forwarded_env()})


def submit_stage(cfg: Any, stage_task: Any, *args: Any) -> Any:
    """Submit a stage to the flow's task runner (a thread locally, a Ray worker in ray mode)."""
    if cfg.cluster.mode != "ray":
        return stage_task.submit(*args)
    with _ray_options(cfg):
        return stage_task.submit(*args)


def call_stage(cfg: Any, stage_task: Any, *args: Any) -> Any:
    """Run a stage and wait: in this process locally, through the task runner in ray mode."""
    if cfg.cluster.mode != "ray":
        return stage_task(*args)
    return submit_stage(cfg, stage_task, *args).result()
