"""One direct-preference RL step (Diffusion-DPO, DiffusionNFT, AWM) as a Prefect flow of staged tasks.

    online:  for each chunk: generate(chunk) ; score(chunk) runs while the next chunk generates
             (DiffusionNFT generates with its old adapter; rollouts are ODE samples, noise level 0)
    offline: offline_pairs(step)  -- the step's (chosen, rejected) pairs from the VAE-latent cache
    advantages(step) -> update_actor(step) (the algorithm's rows: DPO best/worst pair per group,
                        NFT/AWM every sample; + checkpoint) -> sync_weights(step)

The generate, score, advantages and sync stages are the policy-gradient step's own tasks. Every task
is keyed by (run, step, stage, chunk) with a persisted result, so a retried or resumed step reruns
only the stages that did not complete, and a step whose checkpoint exists is not trained again.
"""

from __future__ import annotations

import time

from prefect import flow

from engines import cluster
from flows.rl_step import _num_gpus, _step_metrics
from tasks.advantages import compute_advantages
from tasks.common import call_stage, submit_stage
from tasks.generate import generate_chunk, num_chunks
from tasks.preference import generate_with_old_policy, offline_pairs, update_preference, uses_old_policy_rollout
from tasks.score import score_chunk
from tasks.sync import sync_weights


@flow(name="dp_step", flow_run_name="{run_name}-step-{step}", log_prints=False)
def dp_step(run_name: str, step: int) -> dict:
    """Run direct-preference step `step` of run `run_name` on its registered engines; returns its metrics."""
    engines = cluster.get(run_name)
    cfg = engines.config  # cluster.mode ray: each stage runs as a Ray task calling the run's actors
    t_start = time.perf_counter()
    generated, scored, reward_wait = [], [], 0.0
    if cfg.data.sample_source == "offline":
        samples = call_stage(cfg, offline_pairs, run_name, step)["rows"]
    else:
        generate = generate_with_old_policy if uses_old_policy_rollout(cfg.algorithm) else generate_chunk
        futures = []
        for chunk in range(num_chunks(engines)):
            generated.append(call_stage(cfg, generate, run_name, step, chunk))
            futures.append(submit_stage(cfg, score_chunk, run_name, step, chunk))  # overlaps with the next chunk
        t_rollout_done = time.perf_counter()
        scored = [f.result() for f in futures]
        reward_wait = time.perf_counter() - t_rollout_done
        samples = cfg.rollout.samples_per_step
    reward_stats = call_stage(cfg, compute_advantages, run_name, step)
    update_metrics = call_stage(cfg, update_preference, run_name, step)
    sync_metrics = call_stage(cfg, sync_weights, run_name, step)
    step_seconds = time.perf_counter() - t_start
    metrics = _step_metrics(engines, generated, scored, reward_stats, update_metrics, sync_metrics,
                            step_seconds=step_seconds, reward_wait=reward_wait)
    metrics["perf/throughput"] = samples / step_seconds / _num_gpus()
    return metrics

