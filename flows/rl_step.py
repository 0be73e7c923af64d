"""One policy-gradient RL step as a Prefect flow of staged tasks.

    for each chunk: generate(chunk) ; score(chunk) runs while the next chunk generates
    advantages(step) -> update_actor(step) (+ checkpoint) -> sync_weights(step)

Every task is keyed by (run, step, stage, chunk) with a persisted result: retrying this flow run
(Prefect UI "Retry", or a resumed `diffrl train`) reruns only the stages that did not complete.
"""

from __future__ import annotations

import time

from prefect import flow

from engines import cluster
from tasks.advantages import compute_advantages
from tasks.common import call_stage, submit_stage
from tasks.generate import generate_chunk, num_chunks
from tasks.score import score_chunk
from tasks.sync import sync_weights
from tasks.update import update_actor


@flow(name="rl_step", flow_run_name="{run_name}-step-{step}", log_prints=False)
def rl_step(run_name: str, step: int) -> dict:
    """Run step `step` of run `run_name` on its registered engines; returns the step's metrics."""
    engines = cluster.get(run_name)
    cfg = engines.config  # cluster.mode ray: each stage runs as a Ray task calling the run's actors
    t_start = time.perf_counter()
    generated, scores = [], []
    for chunk in range(num_chunks(engines)):
        generated.append(call_stage(cfg, generate_chunk, run_name, step, chunk))
        scores.append(submit_stage(cfg, score_chunk, run_name, step, chunk))  # overlaps with the next chunk
    t_rollout_done = time.perf_counter()
    scored = [future.result() for future in scores]
    t_scores_done = time.perf_counter()
    reward_stats = call_stage(cfg, compute_advantages, run_name, step)
    update_metrics = call_stage(cfg, update_actor, run_name, step)
    sync_metrics = call_stage(cfg, sync_weights, run_name, step)
    step_seconds = time.perf_counter() - t_start
    return _step_metrics(engines, generated, scored, reward_stats, update_metrics, sync_metrics,
                         step_seconds=step_seconds, reward_wait=t_scores_done - t_rollout_done)


def _step_metrics(engines, generated, scored, reward_stats, update_metrics, sync_metrics, *,
                  step_seconds: float, reward_wait: float) -> dict:
    """DESIGN §4 names: rewards, advantages, actor, timings, throughput."""
    images = engines.config.rollout.samples_per_step
    gen_s = sum(g["seconds"] for g in generated)
    reward_s = sum(s["seconds"] for s in scored)
    metrics = {**reward_stats, **update_metrics, **sync_metrics}
    metrics.update({
        "timing_s/generate": gen_s,
        "timing_s/reward": reward_s,
        "timing_s/reward_wait": reward_wait,
        # share of the reward time hidden behind the rollout (1 = fully overlapped)
        "timing_s/reward_overlap": max(0.0, 1.0 - reward_wait / reward_s) if reward_s > 0 else 1.0,
        "timing_s/step": step_seconds,
        "perf/time_per_step": step_seconds,
        "perf/throughput": images / step_seconds / _num_gpus(),
        "reward/excluded": float(sum(s["excluded"] for s in scored)),
    })
    for stage in ("generate", "reward", "update_actor"):
        key = f"timing_s/{stage}"
        if key in metrics:
            metrics[f"timing_per_image_ms/{stage}"] = 1000.0 * metrics[key] / images
    return metrics


def _num_gpus() -> int:
    import torch

    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
