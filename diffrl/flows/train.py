"""The training run as a Prefect flow: build the engines once, then one `rl_step` subflow per step.

Resume: the same command with the same `run.name` loads the last committed checkpoint and continues;
the interrupted step's completed stages come back Cached (persisted results under the run folder)
and its committed Lance rows are reused. The loggers' runs continue (same run ids, no gaps: runs/<name>/logged.json).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from prefect import flow
from prefect.runtime import flow_run
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from diffrl.configs.changes import Change
from diffrl.configs.loader import to_dict
from diffrl.configs.schema import ExperimentConfig, check_logger_packages, load_experiment
from diffrl.engines import cluster, trace
from diffrl.engines.handle import EngineHandle, Engines
from diffrl.engines.numbering import counted, step_number
from diffrl.engines.redact import redact_text
from diffrl.engines.reward.base import AudioBatch
from diffrl.engines.step.generate import rollout_examples
from diffrl.engines.step.plan import validation_due, validation_rollout
from diffrl.engines.step.retention import (
    checkpoint_bytes,
    describe_disk,
    latent_numel,
    retain,
    sample_noun,
    stored_image_bytes,
)
from diffrl.engines.step.run import StepClock, add_perf, drain, set_first_step, settle, sync_engines
from diffrl.engines.step.update import (
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    point_latest,
    resume_candidates,
)
from diffrl.engines.store import fs
from diffrl.engines.store.integrity import DamagedStore, check_stored
from diffrl.engines.train.checkpoint import CorruptCheckpoint
from diffrl.flows import interrupts
from diffrl.flows.build import build_engines
from diffrl.flows.console import quiet_deployment_run
from diffrl.flows.errors import DamagedRun, RunFailure, cause, chain, is_interrupt, report
from diffrl.flows.guard import Guard
from diffrl.flows.loggers import Place, RunLoggers, mark_run_failed, open_stores
from diffrl.flows.progress import console
from diffrl.flows.provenance import deployment_name, log_final_weights, prompt_inputs, source_tags
from diffrl.flows.rl_step import forget_old_step_runs, rl_step
from diffrl.flows.run_config import check_resume, held_overrides, init_from_run, record_config
from diffrl.flows.run_format import RUN_FORMAT, check_run_format
from diffrl.flows.run_lock import run_lock
from diffrl.flows.tracking import caption
from diffrl.tasks.common import persist_results_in
from diffrl.tasks.stages import (
    check_step_results,
    forget_old_results,
    forget_unfinished,
    last_persisted_step,
    last_started,
    mark_started,
)

log = logging.getLogger("diffrl")


def _say(message: str) -> None:
    console.say(redact_text(message))  # above the live step line, on a terminal; no URL's credentials


def _run_state(cfg: ExperimentConfig) -> dict:
    """runs/<name>/run.json: the run's identity (uid keys its task caches), its on-disk format (stamped once
    check_run_format let it through) and the loggers' run ids."""
    fs.makedirs(fs.join(cfg.run_dir, "checkpoints"))  # a no-op on an object store
    path = fs.join(cfg.run_dir, "run.json")
    state = fs.read_json(path) if fs.exists(path) else {}
    if "uid" not in state or state.get("format") != RUN_FORMAT:
        state.setdefault("uid", uuid.uuid4().hex[:12])
        state["format"] = RUN_FORMAT
        fs.write_json(path, state, indent=2)
    return state


def validation_samples(engines: Engines, step: int):
    """ODE samples (noise level 0) of the fixed validation prompts (runs where the rollout lives)."""
    return validation_rollout(engines.rollout, engines.config, engines.val_prompts, step=step)


def validation_scores(engines: Engines, traj) -> tuple[dict, list[float]]:
    """val/reward and val/<component> of validation samples, and each sample's reward (NaN where excluded) (runs
    where the reward pool lives)."""
    out = engines.reward(traj.outputs, traj.prompts, traj.metadata)
    valid = out.valid
    metrics = {"val/reward": float(out.scores[valid].mean()) if valid.any() else float("nan")}
    for name, values in out.info.items():
        numbers = _per_sample_numbers(values, len(valid))
        if numbers is not None and name != "excluded":
            # a component's own info ("geneval_lite/accuracy") is logged under its last part (val/accuracy)
            key = name.rsplit("/", 1)[-1] if "/" in name else name
            kept = numbers[valid & ~torch.isnan(numbers)]
            metrics[f"val/{key}"] = float(kept.mean()) if kept.numel() else float("nan")
    return metrics, [float(x) if v else float("nan") for x, v in zip(out.scores.tolist(), valid.tolist())]


def _per_sample_numbers(values, count: int) -> torch.Tensor | None:
    """Reward info that is one number (or bool) per sample as a float tensor; None otherwise."""
    if isinstance(values, torch.Tensor):
        return values.float() if values.shape == (count,) else None
    if isinstance(values, list) and len(values) == count and all(isinstance(v, (bool, int, float)) for v in values):
        return torch.tensor([float(v) for v in values])
    return None


def validation_outputs(engines: EngineHandle, step: int = 0) -> tuple:
    """The validation samples at `step` and their (metrics, per-sample rewards)."""
    traj = engines.run("rollout", validation_samples, step)
    return (traj, *engines.run("reward", validation_scores, traj))


def validate(engines: EngineHandle, tracker: RunLoggers, step: int, prepared: tuple | None = None) -> dict:
    """ODE sampling (noise level 0) on the fixed validation prompts; logs val/reward and a grid. `prepared`: the
    validation_outputs `diffrl train` made before the flow started (the validation before training), logged as made."""
    if not engines.config.data.num_val_prompts:
        return {}
    traj, metrics, scores = prepared if prepared is not None else validation_outputs(engines, step)
    _log_samples(engines, tracker, traj.outputs, traj.prompts, scores, "validation", step)
    return metrics


def _log_samples(engines: EngineHandle, tracker: RunLoggers, outputs, prompts, rewards, key: str, step: int) -> None:
    """Up to 16 samples into the loggers: a captioned image grid, audio clips (.wav) with their captions, or a token
    run's responses as a text table."""
    shown = min(len(outputs), 16)
    # a token run's responses are texts, except those of an image-token policy (Janus): its outputs are images
    if engines.config.algorithm.needs.data == "tokens" and not isinstance(outputs, torch.Tensor):
        tracker.log_responses(list(prompts[:shown]), list(outputs[:shown]), list(rewards[:shown]), key, step)
        return
    captions = [caption(p, float(r)) for p, r in zip(prompts[:shown], rewards[:shown])]
    if isinstance(outputs, AudioBatch):  # a model that makes audio: the clips, and the videos they go with
        tracker.log_audio(outputs.waveform[:shown], outputs.sample_rate, captions, key, step)
        if outputs.video is not None:
            tracker.log_images(outputs.video[:shown], captions, key, step)
        return
    images = outputs.numpy() if isinstance(outputs, torch.Tensor) else np.asarray(outputs)
    tracker.log_images(images[:shown], captions, key, step)


def _log_rollout_images(engines: EngineHandle, tracker: RunLoggers, step: int) -> None:
    n = engines.config.run.log_images
    if n <= 0:
        return
    outputs, prompts, rewards = engines.run("rollout", rollout_examples, step, n)
    _log_samples(engines, tracker, outputs, prompts, rewards.tolist(), "rollout", step + 1)


def _ui_url(url: str | None) -> str:
    """The flow run's page in the Prefect UI; "" for the temporary server, which has no UI (Prefect then builds
    "None/runs/...")."""
    return url if url and url.startswith(("http://", "https://")) else ""


def train_run_name() -> str:
    """The train flow run is named after the diffrl run it trains (its run.name), not a random Prefect name."""
    parameters = flow_run.parameters or {}
    try:
        return load_experiment(parameters.get("config"), held_overrides(parameters.get("overrides") or [])).run.name
    except Exception:  # noqa: BLE001 - a bad config is reported by the flow itself, with its own message
        return "train"


@flow(name="train", flow_run_name=train_run_name, log_prints=False)
def train(
    config: str | None = None,
    overrides: list[str] | None = None,
    command_started_at: float | None = None,
    flow_called_at: float | None = None,
    prepared_s: dict[str, float] | None = None,
) -> dict:
    """Train the experiment `config` (a shipped name or a YAML path; default: the quickstart).

    `diffrl train` passes when it started and when it called the flow (Unix times), and the seconds it spent
    preparing the run while Prefect's server booted, by part ("engines", "validation": the engines it registered
    under the run name and their validation before training, which the flow then takes): the startup report's
    parts. Without them (a deployment's run) the report counts from the flow's start and the flow builds its own."""
    startup = Startup(command_started_at, flow_called_at, prepared_s or {})
    quiet_deployment_run()  # a Prefect worker's flow run: the console `diffrl train` gives itself
    overrides = held_overrides(overrides or [])  # the secrets `diffrl train` kept out of the flow's parameters
    cfg = load_experiment(config, overrides)
    check_logger_packages(cfg.run.loggers)  # a logger's missing package fails before any work
    fs.use_options(cfg.run.root, cfg.run.storage_options)  # the run's files on an object store: one set of options
    # one writer per run: a second process is refused here, by pid and host (a lock on the driver's disk)
    with run_lock(cfg.local_dir, cfg.run.name):
        check_run_format(cfg.run_dir, cfg.run.name)  # an older diffrl's run: refused, its MLflow run left as it was
        changes = check_resume(cfg)  # so is a change its stored data cannot take, before anything loads
        try:
            # a Cancel in the Prefect UI stops the run as Ctrl-C does (a worker's run: the worker sends SIGTERM)
            with interrupts.watch_cancel(flow_run.get_id() if deployment_name() is None else None):
                return _train(cfg, startup, config, changes, prepared="engines" in (prepared_s or {}))
        except BaseException as e:
            # whatever failed, before training too (a bad data path on a rerun of a killed run that MLflow still
            # shows RUNNING), the run's MLflow run says FAILED (KILLED when it was interrupted)
            status = "KILLED" if is_interrupt(e) else "FAILED"
            mark_run_failed(cfg.run.loggers, fs.join(cfg.run_dir, "run.json"), status)
            raise


def _train(
    cfg: ExperimentConfig,
    startup: Startup,
    config: str | None = None,
    changes: list[Change] | None = None,
    *,
    prepared: bool = False,
) -> dict:
    mark_started(cfg.run.name, None)  # no step yet (an earlier run of this name in this process has ended)
    _say(
        f"run {cfg.run.name!r}: {counted(cfg.run.steps, 'step')} of {cfg.algorithm.name} on {cfg.model.path} "
        f"({cfg.rollout.samples_per_step} {_noun(cfg)}/step) "
        f"in {cfg.run_dir}" + (f" (lock, Prefect results: {cfg.local_dir})" if fs.is_uri(cfg.run_dir) else "")
    )
    guard = Guard(cfg)  # a bad probe prompt path fails before the model loads
    with ThreadPoolExecutor(max_workers=1) as pool:  # MLflow's database opens (or is created) while the model loads
        store_ready = pool.submit(open_stores, cfg.run.loggers)
        # bad data, model or reward paths fail here, before any work; `diffrl train` may have built them already
        engines, validation = take_prepared(cfg) if prepared else (None, None)
        if engines is None:
            engines = build_engines(cfg)
        startup.mark("engines")
        store_ready.result()
    if cfg.run.trace:  # a timeline of the run's threads (diffrl/engines/trace.py)
        trace.enable(os.path.join(cfg.local_dir, "trace", f"{os.getpid()}.json"))
    engines.set_run_uid(_run_state(cfg)["uid"])  # ray mode: also the actors (the Ray workers running tasks ask them)
    place = Place(cfg.run.experiment, cfg.run.name, state_path=fs.join(cfg.run_dir, "run.json"), folder=cfg.local_dir)
    tracker = RunLoggers(cfg.run.loggers, place, record_path=fs.join(cfg.run_dir, "logged.json"))
    startup.mark("loggers")
    tracker.log_config(to_dict(cfg), file_config=to_dict(load_experiment(config)))  # params: the overrides too
    tracker.set_tags(
        {
            "prefect.flow_run_id": flow_run.get_id() or "",
            "prefect.flow_run_url": _ui_url(flow_run.ui_url),
            "diffrl.run_name": cfg.run.name,
            **source_tags(config, deployment=deployment_name()),
        }
    )
    tracker.log_inputs(prompt_inputs(engines))
    # The stages' results persist as JSON under the run and are read back only through JsonResultStorage; the
    # step's own return value is not persisted (a retried train flow runs a finished step again: all Cached).
    step_flow = persist_results_in(
        rl_step.with_options(persist_result=False, result_serializer="json"), _results_dir(cfg)
    )
    try:
        newest = latest_checkpoint(cfg.run_dir)
        last = None if newest is None else load_good_checkpoint(engines, newest)
        if last is None and cfg.run.init_from:  # before the validation before training: it shows these weights
            init_from_run(engines, tracker)
        # the checkpoint committed but its metrics never reached every logger: step `last` runs again below, every stage
        # Cached but a weight sync whose result was not persisted, which must then be the resume's only sync (a
        # second one gave the next step's rows policy version 3 instead of 2)
        relog = last is not None and not tracker.has_step(last + 1)
        if last is not None and not relog:
            sync_engines(engines, -1, prefetch_next=False)
        if last is not None:
            _say(f"resuming after step {step_number(last)} (checkpoint {checkpoint_dir(cfg.run_dir, last)})")
        start = 0 if last is None else last + 1
        record_config(cfg, tracker, changes or [], start)  # a changed config: said, and recorded in MLflow
        # the last step an earlier process may have left rows or stage results of (beyond a damaged checkpoint, or
        # a step that ran ahead while the checkpoint before it was being written)
        touched = max(start, -1 if newest is None else newest, last_persisted_step(engines, _results_dir(cfg)) or 0)
        engines.run("trainer", set_first_step, touched)  # steps after it cannot have rows from an earlier process
        if engines.store is not None:  # before anything is trained on them, the tables hold what was committed
            check_stored(
                engines.store, None if last is None else checkpoint_dir(cfg.run_dir, last), range(start, touched + 1)
            )
        # logged step = global step (RL steps done): step k's metrics at k + 1, validation before training at 0
        if relog:
            pin_step_key(step_flow, last)
            check_step_results(engines, last, _results_dir(cfg))
            version = engines.run("trainer", _policy_version)
            with step_flow_settings():
                metrics = step_flow(cfg.run.name, last)
                tracker.log_metrics(add_perf(metrics, metrics["timing_s/step"]), last + 1)
            if engines.run("trainer", _policy_version) == version:  # its weight sync came back Cached
                sync_engines(engines, -1, prefetch_next=False)
        for step in range(start, min(touched, cfg.run.steps - 1) + 1) if engines.store is not None else ():
            dropped = forget_unfinished(engines, step, _results_dir(cfg))
            if dropped:
                _say(
                    f"step {step_number(step)} runs again from its first stage whose writes did not land "
                    f"({len(dropped)} persisted results dropped)"
                )
        if start == 0 and "val/reward" not in tracker.before_training:
            val = validate(engines, tracker, 0, prepared=validation)
            if val:  # data.num_val_prompts: 0 validates nothing
                _say(f"before training: {_fmt(val)}")
            tracker.log_values(val, 0)
        if start == 0 and guard.probes_before_training():  # the probes' first values: what a bound compares with
            probe = guard.probe(engines, 0)
            guard.check(probe, 0)
            tracker.log_values(probe, 0)
        startup.mark("validation")
        _say(startup.line())
        tracker.log_values(startup.metrics(), start)
        with step_flow_settings():  # once for all steps: building Prefect settings costs ~30 ms
            val = _train_steps(engines, tracker, step_flow, start, guard)
        engines.run("trainer", drain)  # the last step's rows and checkpoint land before the run reports done
    except BaseException as e:
        console.close()  # the error starts a line of its own
        step, stage = last_started(cfg.run.name)
        with contextlib.suppress(AttributeError):  # the one line of an interrupt or an out-of-memory says where
            e.diffrl_where, e.diffrl_stage = interrupts.where(step, stage), stage
        if is_interrupt(e):  # stop now: no waiting for the step in flight (diffrl/flows/interrupts.py)
            interrupts.stop_engines(engines)
            tracker.finish("KILLED")
            raise
        settle(engines)
        tracker.finish("FAILED")
        damaged = damaged_store(e, cfg)
        if damaged is not None:  # a rerun would fail the same way: say what is broken instead
            raise damaged from e
        lost = cause(e, cluster.ReplicaLost)
        if lost is not None:  # the replicas' process group is broken: fresh actors for the rerun
            cluster.stop_actors(cfg.run.name)
            raise RunFailure(str(lost)) from e
        if deployment_name() is not None and report(e).rerun:  # `diffrl train` says so in its own one line
            _say(resume_advice(cfg))
        raise
    finally:
        if engines.memory is not None:
            engines.memory.close()
        trace.disable()
    console.close()
    final = latest_checkpoint(cfg.run_dir)
    log_final_weights(engines, tracker, final)
    if val:  # the run's validation before training and now, in one line
        _say(f"validation, before -> after training: {summary(tracker, val)}")
    tracker.finish()
    _say(f"done. {tracker.ui_hint}")
    _say(
        f"trajectories: {fs.join(cfg.run_dir, 'trajectories.lance')}; "
        f"checkpoints: {fs.join(cfg.run_dir, 'checkpoints')}"
    )
    run_ids = {f"{name}_run_id": run_id for name, run_id in tracker.run_ids.items()}
    return {"run": cfg.run.name, **run_ids, "last_step": step_number(final), **val}


def take_prepared(cfg: ExperimentConfig) -> tuple[Engines | None, tuple | None]:
    """The engines `diffrl train` built and registered under the run name while Prefect's server booted, with their
    validation before training (taken once), when they were built from exactly this config; else (None, None), and
    engines built from another config are closed (the flow builds its own, which replace them)."""
    engines = cluster.registered(cfg.run.name)
    if not isinstance(engines, Engines):
        return None, None
    if engines.config != cfg:
        if engines.memory is not None:
            engines.memory.close()  # its worker threads end
        return None, None
    validation, engines.validation_before_training = engines.validation_before_training, None
    return engines, validation


def resume_advice(cfg: ExperimentConfig) -> str:
    """What to do after a failed step: rerun the same command, or, for a deployment's flow run (whose command the
    worker ran), retry that flow run, which resumes the same way."""
    where = f"run {cfg.run.name!r}, {cfg.run_dir}"
    if deployment_name() is None:
        return f"step failed; rerun the same command to resume ({where})"
    url = _ui_url(flow_run.ui_url)
    return f"step failed; retry this flow run to resume ({where}): `prefect flow-run retry {flow_run.get_id()}`" + (
        f" or Retry on {url}" if url else " or Retry on its page in the Prefect UI"
    )


def _policy_version(engines: Engines) -> int:
    return engines.policy_version


def damaged_store(error: BaseException, cfg: ExperimentConfig) -> DamagedRun | None:
    """DamagedRun when `error` (or what caused it) is Lance not finding a file of one of the run's tables (a deleted or
    lost data file, which no rerun brings back, so it is no "bad input" to retry) or a DamagedStore
    (a table missing, rows lost or altered: diffrl/engines/store/integrity.py)."""
    for seen in chain(error):
        if isinstance(seen, DamagedStore):
            return DamagedRun(
                f"run {cfg.run.name!r}: {seen}. Rerunning cannot repair it: restore {cfg.run_dir} from a backup, or "
                "train under a new run.name"
            )
        text = str(seen)
        if "Not found" in text and ".lance" in text:
            detail = text.strip().splitlines()[0][:500]
            return DamagedRun(
                f"run {cfg.run.name!r}: a file of its stored data is missing ({detail}). Rerunning cannot bring it "
                f"back: restore {cfg.run_dir} from a backup, or train under a new run.name"
            )
    return None


def load_good_checkpoint(engines: EngineHandle, newest: int) -> int | None:
    """The trainer takes the newest kept checkpoint whose files match their checksums; returns its step. A damaged
    one (diffrl/engines/train/checkpoint.verify) is reported by path and moved aside to step_<k>.corrupt, and the one
    before it is tried; latest.json then names the checkpoint loaded (the steps after it are trained again, on
    their committed rows). None, and no latest.json, when none is good: the run trains from its start."""
    run_dir = engines.config.run_dir
    folder = fs.join(run_dir, "checkpoints")
    if not fs.isdir(checkpoint_dir(run_dir, newest)):  # the pointer is written after its folder: never the other way
        raise DamagedStore(
            f"{fs.join(folder, 'latest.json')} names step {step_number(newest)}, but "
            f"{checkpoint_dir(run_dir, newest)} does not exist"
        )
    for step in resume_candidates(run_dir, newest):
        path = checkpoint_dir(run_dir, step)
        try:
            engines.run("trainer", load_checkpoint, path)
        except CorruptCheckpoint as e:
            aside = path + ".corrupt"
            fs.remove_tree(aside)
            fs.move(path, aside)
            _say(f"checkpoint {path} is damaged, not loaded: {e} (moved to {aside})")
            continue
        if step != newest:
            point_latest(run_dir, step)
            again = f"steps {step_number(step + 1)} to {step_number(newest)}"
            _say(f"resuming from the last good checkpoint, {path}: {again} are trained again")
        return step
    fs.remove(fs.join(folder, "latest.json"))
    _say(f"no good checkpoint left in {folder}: the run trains again from its start, on its committed rows")
    return None


def _results_dir(cfg: ExperimentConfig) -> str:
    """Where the step subflows persist their stage results (their file names are the stages' cache keys): on the
    driver's disk, which Prefect's JsonResultStorage reads."""
    return os.path.abspath(os.path.join(cfg.local_dir, "prefect"))


class Startup:
    """Seconds from the `diffrl` command to the first RL step, by part: imports (before the flow), Prefect (its
    temporary server and the flow run), engines (model load), loggers (run.loggers), validation before training."""

    def __init__(self, command_started_at: float | None, flow_called_at: float | None, prepared_s: dict[str, float]):
        self._last = time.time()
        command = self._last if command_started_at is None else command_started_at
        called = command if flow_called_at is None else flow_called_at
        # what `diffrl train` prepared while Prefect's server booted counts as its own parts, not as imports
        imports = max(0.0, called - command - sum(prepared_s.values()))
        self.parts = {"imports": imports, "prefect": max(0.0, self._last - called), **prepared_s}

    def mark(self, part: str) -> None:
        now = time.time()
        self.parts[part] = self.parts.get(part, 0.0) + now - self._last
        self._last = now

    def metrics(self) -> dict[str, float]:
        return {"startup_s/total": sum(self.parts.values()), **{f"startup_s/{k}": v for k, v in self.parts.items()}}

    def line(self) -> str:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in self.parts.items())
        return f"first step {sum(self.parts.values()):.1f} s after the command ({parts})"


def pin_step_key(step_flow, step: int) -> None:
    """Make the next call of `step_flow` in this flow run Prefect's subflow call number `step`.

    Prefect identifies a subflow call inside a flow run by how many times that subflow has been called
    so far in the run. A retried train flow run resumes at its first unfinished step, so
    without this its first call (step k) would be matched to the original run's first call (step 0):
    Prefect would hand back step 0's Completed subflow run and step k would never run. Pinned to the step
    number, a retry finds step k's own Failed subflow run and starts it afresh, and its completed stages
    come back Cached (their cache keys are per run, step, stage and chunk).
    """
    from prefect.context import FlowRunContext
    from prefect.tasks import Task

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    # the task Prefect creates in the parent run to track a subflow call is keyed by the flow's function
    key = Task(name=step_flow.name, fn=step_flow.fn, version=step_flow.version).task_key
    context.task_run_dynamic_keys[key] = step - 1  # Prefect adds 1 before using it


def step_flow_settings():
    """Settings of the per-step subflow runs: no heartbeats. Prefect's heartbeat thread sleeps in 1 s
    slices and a finishing flow run joins it, which cost ~0.5 s of every step (benchmarks/
    orchestration.py). The train flow run around the steps keeps its heartbeats (its thread started
    before, with its own copy of the settings), so a crashed process is still detected there."""
    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def _train_steps(engines: EngineHandle, tracker: RunLoggers, step_flow, start: int, guard: Guard) -> dict:
    """Steps start..steps-1, each a subflow; validation, guard probes, logging and retention after each; a step that
    passes a hacking-guard bound is the last. A step's time is the time between the ends of two steps, validation and
    probes left out (diffrl/engines/step/run.StepClock): with the next step's rollout started right after a weight
    sync, that is what a step costs the run."""
    cfg = engines.config
    val = {}
    clock, times = StepClock(), []
    unit = _noun(cfg) if cfg.algorithm.needs.data == "tokens" else engines.run("rollout", sample_noun)
    for step in range(start, cfg.run.steps):
        mark_started(cfg.run.name, step)  # where an interrupt finds the run (with the stage its tasks started)
        pin_step_key(step_flow, step)
        check_step_results(engines, step, _results_dir(cfg))
        with trace.span("step subflow", step=step):
            metrics = step_flow(cfg.run.name, step)
        with trace.span("rollout images", step=step):
            _log_rollout_images(engines, tracker, step)
        engines.run("rollout", retain, step)  # on the first replica's writer, behind its step's writes
        forget_old_results(engines, step, _results_dir(cfg))
        forget_old_step_runs(cfg.run.name, step)  # Prefect's database keeps the last steps' subflow runs
        metrics = add_perf(metrics, clock.lap())
        times.append(metrics["perf/time_per_step"])
        if step == start:  # the run's disk, with its images as the first step stored them
            with clock.excluded():
                _say_disk(engines, step)
        if validation_due(cfg, step + 1):
            with clock.excluded():
                val = validate(engines, tracker, step + 1)
            metrics.update(val)
        with clock.excluded():
            metrics.update(guard.probe(engines, step + 1))
        with trace.span("log metrics", step=step):
            tracker.log_metrics(metrics, step + 1)
        trace.flush()
        shown = ("fm_loss", "actor/fm_loss") if cfg.algorithm.needs.supervised else ("reward", "critic/rewards/mean")
        console.step(  # a live line on a terminal, one plain line per step elsewhere
            step + 1,
            cfg.run.steps,
            f"{shown[0]} {metrics.get(shown[1], float('nan')):.4f}, "  # SFT has no reward: its matching loss
            f"{metrics['perf/throughput']:.2f} {unit}/s ({metrics['perf/time_per_step']:.2f} s)"
            + _eta(times, cfg.run.steps - step - 1),
            note=_fmt(val) if val and validation_due(cfg, step + 1) else "",
        )
        stop = guard.check(metrics, step + 1)
        if stop is not None:  # the step is committed and logged: the run ends as a finished one, resumable
            _say(stop)
            tracker.set_tags({"diffrl.guard_stop": stop})
            break
    return val


def _say_disk(engines: cluster.Engines, step: int) -> None:
    cfg = engines.config
    if engines.store is not None and cfg.data.sample_source == "online" and cfg.algorithm.needs.data != "tokens":
        # from the first replica only: another's process may be gone mid-step, which the next stage reports
        latent, checkpoint = engines.run("rollout", latent_numel), engines.run_one("trainer", 0, checkpoint_bytes)
        _say(describe_disk(cfg, latent, checkpoint, engines.run("rollout", stored_image_bytes, step)))


def _noun(cfg: ExperimentConfig) -> str:
    """What a step's samples are, as the config tells before the model loads: responses, videos, clips (audio) or
    images."""
    if cfg.algorithm.needs.data == "tokens":
        return "responses"
    if cfg.rollout.num_frames > 1:
        return "videos"
    return "clips" if cfg.rollout.duration is not None else "images"


def _eta(step_seconds: list[float], steps_left: int) -> str:
    """The time left at the median of the last 10 steps' times (validation not counted): ", eta 4m10s"."""
    if not steps_left or not step_seconds:
        return ""
    recent = sorted(step_seconds[-10:])
    minutes, seconds = divmod(round(recent[len(recent) // 2] * steps_left), 60)
    hours, minutes = divmod(minutes, 60)
    return f", eta {f'{hours}h{minutes:02d}m' if hours else f'{minutes}m{seconds:02d}s'}"


def summary(tracker: RunLoggers, last: dict) -> str:
    """Each validation metric before training and at the last validation: "val/accuracy 0.2132 -> 0.3211, ..."."""
    parts = []
    for key, after in last.items():
        before = tracker.before_training.get(key)
        parts.append(f"{key} {before:.4f} -> {after:.4f}" if before is not None else f"{key} {after:.4f}")
    return ", ".join(parts)


def _fmt(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
