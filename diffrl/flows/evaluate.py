"""The evaluation flow: a run's checkpoint, ODE-sampled on the validation prompts, scored, logged (run.loggers).

Logged as val/* into its own run `<run.name>-eval` of each logger (same experiment; runs/<name>/eval.json keeps
its ids, so re-evaluations of later checkpoints continue it), at the global step of the checkpoint.

A training run beside it keeps only some checkpoints (`run.checkpoint_every`, the latest two): the checkpoint is
taken first into a folder of its own (hard links, no copy, on the same disk), which the training run's retention
cannot remove while the model loads.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from prefect import flow

from diffrl.configs.schema import check_logger_packages, load_experiment
from diffrl.engines.step.run import sync_engines
from diffrl.engines.step.update import checkpoint_dir, latest_checkpoint, load_checkpoint
from diffrl.engines.store import fs
from diffrl.flows.build import build_engines
from diffrl.flows.console import quiet_deployment_run
from diffrl.flows.loggers import Place, RunLoggers
from diffrl.flows.run_format import check_run_format
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


def take_checkpoint(cfg, checkpoint: str | None, folder: str, attempts: int = 5) -> tuple[str, str]:
    """(the checkpoint evaluated, its copy under `folder`): `checkpoint`, or the run's latest, taken as it is now. A
    latest checkpoint that retention removes while it is taken is replaced by the new latest; a named one is an
    error."""
    for _ in range(attempts):
        source = resolve_checkpoint(cfg, checkpoint)
        source = source if fs.is_uri(source) else os.path.abspath(source)
        taken = os.path.join(folder, fs.basename(source))
        try:
            fs.snapshot(source, taken)
            return source, taken
        except FileNotFoundError as e:
            shutil.rmtree(taken, ignore_errors=True)
            if checkpoint is not None:
                raise ValueError(f"checkpoint {source!r} was removed while it was read ({e.filename})") from e
    raise ValueError(f"run {cfg.run.name!r}: its latest checkpoint kept being replaced while it was read")


@flow(name="evaluate", log_prints=False)
def evaluate(config: str | None = None, overrides: list[str] | None = None, checkpoint: str | None = None) -> dict:
    """Evaluate `checkpoint` (default: the run's latest) of experiment `config`; returns the val/* metrics."""
    quiet_deployment_run()  # a Prefect worker's flow run: the console `diffrl` gives itself
    cfg = load_experiment(config, overrides or [])
    check_logger_packages(cfg.run.loggers)
    fs.use_options(cfg.run.root, cfg.run.storage_options)
    pinned = tempfile.mkdtemp(prefix="diffrl-eval-", dir=cfg.local_dir if os.path.isdir(cfg.local_dir) else None)
    try:
        checkpoint, taken = take_checkpoint(cfg, checkpoint, pinned)
        engines = build_engines(cfg)
        step = engines.run("trainer", load_checkpoint, taken)  # its step number: RL steps done
    finally:
        shutil.rmtree(pinned, ignore_errors=True)
    sync_engines(engines, -1, prefetch_next=False)
    # its own run in each logger; TensorBoard's and W&B's files in runs/<name>/eval
    name, state = f"{cfg.run.name}-eval", fs.join(cfg.run_dir, "eval.json")
    tracker = RunLoggers(cfg.run.loggers, Place(cfg.run.experiment, name, state, os.path.join(cfg.local_dir, "eval")))
    tracker.set_tags({"diffrl.run_name": name, "diffrl.checkpoint": checkpoint})
    metrics = validate(engines, tracker, step)  # at the logged step the training run validated this checkpoint
    tracker.log_values(metrics, step)
    tracker.finish()
    print(f"[diffrl] evaluated {checkpoint}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return {"checkpoint": checkpoint, "step": step, **metrics}
