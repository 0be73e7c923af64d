"""What every stage task shares: its cache key is (run incarnation, step, stage, chunk), so a retried or
resumed flow run finds a completed stage Cached instead of running it again, and results are small
JSON records persisted with the run."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any, Callable

from engines import cluster


def stage_cache_key(stage: str) -> Callable[[Any, dict], str]:
    """Prefect cache_key_fn for a stage: same run, step and chunk -> the same key."""
    def key(_context: Any, params: dict) -> str:
        run_name = params["run_name"]
        uid = cluster.get(run_name).extras.get("run_uid", "")
        return f"diffrl-{run_name}-{uid}-step{params['step']}-{stage}-{params.get('chunk', 0)}"
    return key


# Keyword arguments every stage task shares (persisted JSON results -> Cached on retry/resume).
STAGE = dict(persist_result=True, result_serializer="json", retries=0)


def sample_seed(run_seed: int, step: int, global_index: int) -> int:
    """A per-sample generator seed that depends only on (run seed, step, sample position)."""
    digest = hashlib.sha256(f"{run_seed}:{step}:{global_index}".encode()).digest()
    return int.from_bytes(digest[:7], "little")  # < 2**56: fits torch.Generator.manual_seed


def validation_batch(records: list, run_seed: int, copies: int = 1) -> dict:
    """`RolloutEngine.generate` arguments for `copies` images of each validation prompt record: copy c of
    record i has sample index c and seed run_seed + 7 + i + c * len(records) (copy 0 keeps the seeds a
    one-image validation always used), and carries the record's ground truth for the reward."""
    n = len(records)
    rows = [(c, i) for c in range(copies) for i in range(n)]
    return dict(prompts=[records[i].prompt for _, i in rows], group_ids=[records[i].uid for _, i in rows],
                sample_index=[c for c, _ in rows], seeds=[run_seed + 7 + i + c * n for c, i in rows],
                metadata=[{"ground_truth": records[i].ground_truth, **records[i].metadata} for _, i in rows])


def validation_rollout(rollout, cfg, records: list, *, step: int = 0, **sampling):
    """ODE samples (noise level 0) of the validation `records`, `cfg.data.val_samples_per_prompt` each
    (validation_batch's seeds), with the config's sampling; `sampling` overrides its fields (guidance_scale,
    num_inference_steps). An SDE window longer than the steps is cut to them: at noise 0 it only marks steps."""
    ode = dataclasses.replace(cfg.sampling, noise_level=0.0, **sampling)
    if ode.window.size > ode.num_inference_steps:
        ode = dataclasses.replace(ode, window=dataclasses.replace(ode.window, size=ode.num_inference_steps,
                                                                  start_range=(0, None)))
    batch = validation_batch(records, cfg.run.seed, cfg.data.val_samples_per_prompt)
    return rollout.generate(cfg=ode, step=step, **batch)


def inject_fault(stage: str, step: int, chunk: int = 0) -> None:
    """Fault injection for resume/retry tests and drills: DIFFRL_INJECT_FAULT="stage@step[.chunk][:exit]".

    `raise` (default) fails the task with RuntimeError, as an out-of-memory would; `exit` kills the
    process on the spot (os._exit(137), like SIGKILL) to test crash recovery. Unset: does nothing.
    """
    spec = os.environ.get("DIFFRL_INJECT_FAULT", "")
    if not spec:
        return
    where, _, action = spec.partition(":")
    target_stage, _, position = where.partition("@")
    target_step, _, target_chunk = position.partition(".")
    if target_stage != stage or int(target_step or -1) != step or int(target_chunk or 0) != chunk:
        return
    if action == "exit":
        os._exit(137)
    raise RuntimeError(f"injected fault in stage {stage!r} at step {step} chunk {chunk} (DIFFRL_INJECT_FAULT)")


def step_runner(cfg: Any) -> dict:
    """rl_step options for the run's cluster mode: ray -> prefect-ray's RayTaskRunner on the run's cluster."""
    if cfg.cluster.mode != "ray":
        return {}
    from prefect_ray import RayTaskRunner

    return {"task_runner": RayTaskRunner(address=cfg.cluster.address or os.environ.get("RAY_ADDRESS") or "auto",
                                         init_kwargs={"runtime_env": {"env_vars": cluster.forwarded_env()}})}


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
    """Run a stage and wait: in this process locally (as before), through the task runner in ray mode."""
    if cfg.cluster.mode != "ray":
        return stage_task(*args)
    return submit_stage(cfg, stage_task, *args).result()
