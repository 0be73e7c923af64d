"""The evaluation flow: a run's checkpoint, ODE-sampled on the validation prompts, scored, logged to MLflow.

Logged as val/* into its own MLflow run `<run.name>-eval` (same experiment; runs/<name>/eval.json keeps
its id, so re-evaluations of later checkpoints continue it), at the global step of the checkpoint.
"""

from __future__ import annotations

import os

from prefect import flow

from diffrl.configs.schema import load_experiment
from diffrl.engines.step.run import sync_engines
from diffrl.engines.step.update import checkpoint_dir, latest_checkpoint, load_checkpoint
from diffrl.engines.store import fs
from diffrl.flows.build import build_engines
from diffrl.flows.console import quiet_deployment_run
from diffrl.flows.run_format import check_run_format
from diffrl.flows.tracking import Tracker
from diffrl.flows.train import validate


def resolve_checkpoint(cfg, checkpoint: str | None) -> str:
    """The checkpoint folder to evaluate: `checkpoint`, or the run's latest; ValueError when there is none,
    OldRunFormat for a run an older diffrl numbered."""
    check_run_format(cfg.run_dir, cfg.run.name)
    if checkpoint is None:
        last = latest_checkpoint(cfg.run_dir)
        if last is None:
            raise ValueError(
                f"checkpoint: run {cfg.run.name!r} has no checkpoint in {cfg.run_dir}; train it first "
                "or pass --checkpoint <path to a checkpoints/step_<k> folder>"
            )
        checkpoint = checkpoint_dir(cfg.run_dir, last)
    if not fs.isdir(checkpoint):
        raise ValueError(f"checkpoint {checkpoint!r} is not a folder (expected runs/<name>/checkpoints/step_<k>)")
    return checkpoint


@flow(name="evaluate", log_prints=False)
def evaluate(config: str | None = None, overrides: list[str] | None = None, checkpoint: str | None = None) -> dict:
    """Evaluate `checkpoint` (default: the run's latest) of experiment `config`; returns the val/* metrics."""
    quiet_deployment_run()  # a Prefect worker's flow run: the console `diffrl` gives itself
    cfg = load_experiment(config, overrides or [])
    fs.use_options(cfg.run.root, cfg.run.storage_options)
    checkpoint = resolve_checkpoint(cfg, checkpoint)
    engines = build_engines(cfg)
    checkpoint = checkpoint if fs.is_uri(checkpoint) else os.path.abspath(checkpoint)
    step = engines.run("trainer", load_checkpoint, checkpoint)  # its step number: RL steps done
    sync_engines(engines, -1, prefetch_next=False)
    tracker = Tracker(
        experiment=cfg.run.experiment,
        run_name=f"{cfg.run.name}-eval",
        state_path=os.path.join(cfg.run_dir, "eval.json"),
    )
    tracker.set_tags({"diffrl.run_name": f"{cfg.run.name}-eval", "diffrl.checkpoint": checkpoint})
    metrics = validate(engines, tracker, step)  # at the MLflow step the training run validated this checkpoint
    tracker.log_values(metrics, step)
    tracker.finish()
    print(f"[diffrl] evaluated {checkpoint}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return {"checkpoint": checkpoint, "step": step, **metrics}
