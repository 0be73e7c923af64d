"""Where a run's metrics, samples (images, audio clips) and config go: `run.loggers`, any of mlflow, tensorboard and
wandb (docs/training.md).

Every logger gets the same calls: the same metric names (docs/training.md, "Metrics") at the same steps (the global
step, RL steps done; the validation before training at 0). The run folder, not a logger, keeps what resume needs:
runs/<name>/logged.json holds the last step whose metrics every logger took and the validation before training, so
a run resumes the same with any set of loggers, none included. A step's record is written once every logger's writes
for it have landed: a crash can lose the last step's metrics, and the resumed run logs them again
(diffrl/flows/train.py), except to MLflow where its history holds them already.

- mlflow: the tracking database (mlflow.db, or MLFLOW_TRACKING_URI), diffrl/flows/tracking.py.
- tensorboard: event files in runs/<name>/tensorboard (`tensorboard --logdir runs/<name>`); the tensorboard package.
- wandb: an offline W&B run in runs/<name>/wandb (WANDB_MODE=offline unless set; `wandb sync` uploads it); the
  wandb package. A resumed run writes another offline folder under the same run id; `wandb sync` joins them.
A remote run root (s3://...) keeps the event and W&B files in runs/<name> under the working directory.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import uuid
from typing import Any, Protocol

import numpy as np
import yaml

from diffrl import registry
from diffrl.configs.schema import LOGGER_PACKAGES, check_logger_packages
from diffrl.engines.redact import redact, redact_text
from diffrl.engines.step.background import Background
from diffrl.engines.store import fs
from diffrl.flows.tracking import Tracker, caption, image_grid, mark_failed, open_tracking_store

log = logging.getLogger("diffrl")

registry.declare("logger", (), label="run logger")
LABELS = {"mlflow": "MLflow", "tensorboard": "TensorBoard", "wandb": "W&B"}


class RunLogger(Protocol):
    """One logger of a run. Writes queue on the logger's own thread, so the training loop never waits for a database
    or a file; `wait(step)` blocks until the writes queued for steps <= step have landed."""

    run_id: str | None

    def log_config(self, config: dict) -> None: ...
    def log_config_change(self, config: dict, step: int, changes: list[str]) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_values(self, metrics: dict[str, float], step: int) -> None: ...
    def log_images(self, images_BHW3: np.ndarray, captions: list[str], key: str, step: int) -> None: ...
    def log_audio(
        self, waveforms_BCT: np.ndarray, sample_rate: int, captions: list[str], key: str, step: int
    ) -> None: ...
    def log_responses(
        self, prompts: list[str], responses: list[str], rewards: list[float], key: str, step: int
    ) -> None: ...
    def log_inputs(self, datasets: list) -> None: ...
    def log_lora(self, checkpoint: str, *, base_model: str, step: int) -> None: ...
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None: ...
    def wait(self, step: int) -> None: ...
    def flush(self) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...
    @property
    def ui_hint(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class Place:
    """What a logger is opened with: the experiment and run names, the state file keeping its run id (run.json), the
    local folder its files go to, and the first step this process logs (earlier ones are in the run's record)."""

    experiment: str
    run_name: str
    state_path: str
    folder: str
    first_step: int = 0


def _require(name: str) -> Any:
    """The package logger `name` writes with, imported; a ValueError naming the extra to install when it is missing."""
    check_logger_packages([name])
    return importlib.import_module(LOGGER_PACKAGES[name])


def open_stores(names: list[str] | tuple[str, ...]) -> None:
    """Open what a logger of `names` keeps its runs in ahead of the run (MLflow's database: seconds when new)."""
    if "mlflow" in names:
        open_tracking_store()


def mark_run_failed(names: list[str] | tuple[str, ...], state_path: str, status: str = "FAILED") -> None:
    """Mark the run FAILED (or `status`: KILLED, interrupted) where a logger keeps a run state outside this process
    (MLflow's database), also for a failure before the loggers were opened."""
    if "mlflow" in names:
        mark_failed(state_path, status)


class LoggedRecord:
    """runs/<name>/logged.json: {"step": the last step whose metrics every logger took (0: none), "before_training":
    the validation before training}. None as the path: nothing kept (an evaluation's loggers)."""

    def __init__(self, path: str | None):
        self.path = path
        data = fs.read_json(path) if path is not None and fs.exists(path) else None
        self.found = data is not None
        self.step = int((data or {}).get("step", 0))
        self.before_training = {k: float(v) for k, v in (data or {}).get("before_training", {}).items()}

    def write(self, step: int, before_training: dict[str, float]) -> None:
        fs.write_json(self.path, {"step": step, "before_training": before_training}, indent=2)


class RunLoggers:
    """The loggers of one run behind one set of calls, and the run folder's record of what they all took."""

    def __init__(self, names: list[str] | tuple[str, ...], place: Place, *, record_path: str | None = None):
        self.record = LoggedRecord(record_path)
        self._record_writes = Background("run record")
        opened: dict[str, RunLogger] = {}
        # the last step a logger holds beyond the record: a crash after MLflow took a step's metrics, before the record
        # said so, is not logged twice (TensorBoard purges from the resumed step itself; W&B starts another folder)
        self.holds: dict[str, int] = {}
        if "mlflow" in names and record_path is not None:
            tracker = opened["mlflow"] = _mlflow(place)
            last, before = tracker.logged()
            if not self.record.found:  # a run an older diffrl started has no record: what MLflow holds it logged
                self.record.step, self.record.before_training = last, before
            self.holds["mlflow"] = last
        place = dataclasses.replace(place, first_step=self.record.step + 1)
        self.loggers = {name: opened.get(name) or registry.get("logger", name).obj(place) for name in names}

    @property
    def before_training(self) -> dict[str, float]:
        """val/* of the validation before training (logged at step 0), this process's or an earlier one's."""
        return self.record.before_training

    @property
    def run_ids(self) -> dict[str, str]:
        """{logger: its run id} for the loggers that have one (MLflow, W&B)."""
        return {name: logger.run_id for name, logger in self.loggers.items() if logger.run_id}

    @property
    def ui_hint(self) -> str:
        """How to look at the run in each logger: "MLflow: diffrl ui ...; TensorBoard: tensorboard --logdir ..."."""
        return "; ".join(f"{LABELS[name]}: {logger.ui_hint}" for name, logger in self.loggers.items())

    def has_step(self, step: int) -> bool:
        """Whether step `step`'s metrics were logged (by this process or, per the record, an earlier one)."""
        return 1 <= step <= self.record.step

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log a step's metrics once: a step the record has (a resumed run) is not logged twice."""
        if self.has_step(step):
            return
        for name, logger in self.loggers.items():
            if step > self.holds.get(name, 0):
                logger.log_values(metrics, step)
        self.record.step = step
        self._keep_record(step)

    def log_values(self, metrics: dict[str, float], step: int) -> None:
        """Log metrics at `step` without the once-per-step bookkeeping (validation, startup times); val/* at step 0
        is the validation before training, kept in the record."""
        for logger in self.loggers.values():
            logger.log_values(metrics, step)
        before = {k: float(v) for k, v in metrics.items() if k.startswith("val/")} if step == 0 else {}
        if before:
            self.record.before_training.update(before)
            self._keep_record(0)

    def _keep_record(self, step: int) -> None:
        if self.record.path is None:
            return
        snapshot = (self.record.step, dict(self.record.before_training))
        self._record_writes.submit(step, f"run record step {step}", self._write_record, step, *snapshot)

    def _write_record(self, step: int, logged: int, before_training: dict[str, float]) -> None:
        for logger in self.loggers.values():  # the record says logged only once every logger has it
            logger.wait(step)
        self.record.write(logged, before_training)

    def log_config(self, config: dict, file_config: dict | None = None) -> None:
        """The run's config, secrets replaced by *** (diffrl/engines/redact.py); `file_config`, the config file's own
        values, lets MLflow's params show what the overrides changed (the others take the whole config)."""
        for name, logger in self.loggers.items():
            if name == "mlflow":
                logger.log_config(config, file_config=file_config)
            else:
                logger.log_config(redact(config))

    def log_config_change(self, config: dict, step: int, changes: list[str]) -> None:
        """A config changed on resume, in effect from step `step` (diffrl/flows/run_config.py)."""
        self._each("log_config_change", redact(config), step, [redact_text(c) for c in changes])

    def set_tags(self, tags: dict[str, str]) -> None:
        self._each("set_tags", {key: redact_text(str(value)) for key, value in tags.items()})

    def log_images(self, images_BHW3: np.ndarray, captions: list[str], key: str, step: int) -> None:
        self._each("log_images", images_BHW3, captions, key, step)

    def log_audio(self, waveforms_BCT: np.ndarray, sample_rate: int, captions: list[str], key: str, step: int) -> None:
        self._each("log_audio", waveforms_BCT, sample_rate, captions, key, step)

    def log_responses(self, prompts: list[str], responses: list[str], rewards: list[float], key: str, step: int):
        self._each("log_responses", prompts, responses, rewards, key, step)

    def log_inputs(self, datasets: list) -> None:
        self._each("log_inputs", datasets)

    def log_lora(self, checkpoint: str, *, base_model: str, step: int) -> None:
        self._each("log_lora", checkpoint, base_model=base_model, step=step)

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        self._each("log_artifact", local_path, artifact_path)

    def _each(self, method: str, *args: Any, **kwargs: Any) -> None:
        for logger in self.loggers.values():
            getattr(logger, method)(*args, **kwargs)

    def flush(self) -> None:
        """Wait for every logger's queued writes and the record (raises the first that failed)."""
        self._each("flush")
        self._record_writes.flush()

    def finish(self, status: str = "FINISHED") -> None:
        """Wait for the queued writes and the record, then close every logger (its run marked `status`). A failed
        write is raised unless the run failed already: then the run's own error is the one to see."""
        errors = []
        try:
            self._record_writes.flush()
        except Exception as e:  # noqa: BLE001 - every logger is closed before the first error is raised
            errors.append(e)
        for logger in self.loggers.values():
            try:
                logger.finish(status)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        self._record_writes.close()
        if errors and status == "FINISHED":
            raise errors[0]
        for e in errors:
            log.error("logging failed too: %s", e)


@registry.register("logger", "mlflow")
def _mlflow(place: Place) -> Tracker:
    return Tracker(experiment=place.experiment, run_name=place.run_name, state_path=place.state_path)


class _Queued:
    """The TensorBoard and W&B loggers' shared part: their writer thread, and nothing for MLflow's own records (dataset
    inputs, the logged LoRA model, artifacts; the run folder keeps the checkpoints, `diffrl export` makes the LoRA)."""

    run_id: str | None = None

    def __init__(self, name: str):
        self._writes = Background(name)

    def _submit(self, step: int, what: str, fn, *args) -> None:
        self._writes.submit(step, what, fn, *args)

    def log_inputs(self, datasets: list) -> None:
        pass

    def log_config_change(self, config: dict, step: int, changes: list[str]) -> None:
        """The new config replaces the recorded one; the tags say from which step and what changed."""
        self.log_config(config)
        self.set_tags({"diffrl.config_changed_at_step": str(step), "diffrl.config_changes": "; ".join(changes)})

    def log_lora(self, checkpoint: str, *, base_model: str, step: int) -> None:
        pass

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        pass

    def wait(self, step: int) -> None:
        self._writes.wait(step)

    def flush(self) -> None:
        self._writes.flush()

    def finish(self, status: str = "FINISHED") -> None:
        try:
            self._writes.flush()
        finally:
            self._close(status)
            self._writes.close()

    def _close(self, status: str) -> None:
        raise NotImplementedError


class TensorBoardLogger(_Queued):
    """Event files in <folder>/tensorboard: scalars, image grids (as MLflow's, captioned), the config and tags and a
    token run's responses as text. Each step's events are flushed to disk before the run's record says it logged."""

    def __init__(self, place: Place):
        super().__init__("tensorboard")
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.folder = os.path.join(place.folder, "tensorboard")
        # TensorBoard hides what an earlier, crashed process wrote for the steps this one logs again (purge_step)
        self.writer = SummaryWriter(self.folder, purge_step=place.first_step)

    @property
    def ui_hint(self) -> str:
        return f"tensorboard --logdir {self.folder}"

    def log_config(self, config: dict) -> None:
        text = yaml.safe_dump(config, sort_keys=False)
        self._submit(0, "TensorBoard config", self._text, "config", _code(text), 0)

    def set_tags(self, tags: dict[str, str]) -> None:
        rows = "\n".join(f"| {key} | {value} |" for key, value in tags.items())
        self._submit(0, "TensorBoard tags", self._text, "tags", f"| tag | value |\n|---|---|\n{rows}", 0)

    def log_values(self, metrics: dict[str, float], step: int) -> None:
        self._submit(step, "TensorBoard scalars", self._scalars, dict(metrics), step)

    def _scalars(self, metrics: dict[str, float], step: int) -> None:
        for key, value in sorted(metrics.items()):
            self.writer.add_scalar(key, float(value), step)  # NaN and inf as such: a NaN loss must show
        self.writer.flush()

    def log_images(self, images_BHW3: np.ndarray, captions: list[str], key: str, step: int) -> None:
        self._submit(step, f"TensorBoard image {key} step {step}", self._image, images_BHW3, captions, key, step)

    def _image(self, images_BHW3: np.ndarray, captions: list[str], key: str, step: int) -> None:
        self.writer.add_image(key, image_grid(images_BHW3, captions), step, dataformats="HWC")
        self.writer.flush()

    def log_audio(self, waveforms_BCT: np.ndarray, sample_rate: int, captions: list[str], key: str, step: int) -> None:
        self._submit(step, f"TensorBoard audio {key} step {step}", self._audio, waveforms_BCT, sample_rate, key, step)

    def _audio(self, waveforms_BCT: np.ndarray, sample_rate: int, key: str, step: int) -> None:
        for i, waveform_CT in enumerate(waveforms_BCT):  # TensorBoard plays mono clips: the channels' mean
            self.writer.add_audio(f"{key}/{i}", waveform_CT.mean(0, keepdims=True), step, sample_rate=sample_rate)
        self.writer.flush()

    def log_responses(self, prompts: list[str], responses: list[str], rewards: list[float], key: str, step: int):
        lines = [f"{caption(p, r)}\n    -> {text!r}" for p, text, r in zip(prompts, responses, rewards)]
        self._submit(step, f"TensorBoard {key}", self._text, key, _code("\n".join(lines)), step)

    def _text(self, key: str, text: str, step: int) -> None:
        self.writer.add_text(key, text, step)
        self.writer.flush()

    def _close(self, status: str) -> None:
        self.writer.close()


def _code(text: str) -> str:
    """Text TensorBoard shows as written (its text tab renders Markdown: an indented block is code)."""
    return "\n".join("    " + line for line in text.splitlines())


@registry.register("logger", "tensorboard")
def _tensorboard(place: Place) -> TensorBoardLogger:
    return TensorBoardLogger(place)


class WandbLogger(_Queued):
    """A W&B run, offline unless WANDB_MODE says otherwise, its files under <folder>/wandb; its id is kept in the run's
    state file (run.json), so a resumed run logs under the same id. The wandb package's own service process writes
    the files: what it was handed before a crash is kept."""

    def __init__(self, place: Place):
        super().__init__("wandb")
        wandb = _require("wandb")
        self._wandb = wandb
        state = fs.read_json(place.state_path) if fs.exists(place.state_path) else {}
        if not state.get("wandb_run_id"):
            state["wandb_run_id"] = uuid.uuid4().hex[:12]  # W&B run ids: letters and digits
            fs.write_json(place.state_path, state, indent=2)
        self.run_id = state["wandb_run_id"]
        self.folder = place.folder
        os.makedirs(self.folder, exist_ok=True)
        self.mode = os.environ.get("WANDB_MODE", "offline")
        # console off: wandb would wrap stdout and stderr (the live step line); silent: no banner lines
        settings = wandb.Settings(mode=self.mode, console="off", silent=True)
        self.run = wandb.init(
            project=place.experiment,
            name=place.run_name,
            id=self.run_id,
            resume="allow",
            dir=os.path.abspath(self.folder),  # wandb's service process may run in another working directory
            settings=settings,
            reinit="create_new",  # one W&B run per diffrl run, several in one process (tests, notebooks)
        )

    @property
    def ui_hint(self) -> str:
        if self.mode == "offline":
            return f"wandb sync {os.path.join(self.folder, 'wandb', f'offline-run-*-{self.run_id}*')}"
        return self.run.url or self.run_id

    def log_config(self, config: dict) -> None:
        self._submit(0, "W&B config", self._config, config)

    def set_tags(self, tags: dict[str, str]) -> None:
        # W&B's own tags are short labels; diffrl's are key-value (source, git commit, Prefect flow run)
        self._submit(0, "W&B tags", self._config, {"diffrl_tags": dict(tags)})

    def _config(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)  # a resumed run records its config again

    def log_values(self, metrics: dict[str, float], step: int) -> None:
        values = {key: float(value) for key, value in metrics.items()}
        self._submit(step, "W&B metrics", self._log, values, step)

    def log_images(self, images_BHW3: np.ndarray, captions: list[str], key: str, step: int) -> None:
        self._submit(step, f"W&B image {key} step {step}", self._image, images_BHW3, captions, key, step)

    def _image(self, images_BHW3: np.ndarray, captions: list[str], key: str, step: int) -> None:
        self._log({key: self._wandb.Image(image_grid(images_BHW3, captions))}, step)

    def log_audio(self, waveforms_BCT: np.ndarray, sample_rate: int, captions: list[str], key: str, step: int) -> None:
        self._submit(step, f"W&B audio {key} step {step}", self._audio, waveforms_BCT, sample_rate, captions, key, step)

    def _audio(self, waveforms_BCT: np.ndarray, sample_rate: int, captions: list[str], key: str, step: int) -> None:
        clips = [self._wandb.Audio(w.T, sample_rate=sample_rate, caption=c) for w, c in zip(waveforms_BCT, captions)]
        self._log({key: clips}, step)

    def log_responses(self, prompts: list[str], responses: list[str], rewards: list[float], key: str, step: int):
        rows = [[float(r), p, text] for p, text, r in zip(prompts, responses, rewards)]
        self._submit(step, f"W&B {key}", self._table, rows, key, step)

    def _table(self, rows: list[list], key: str, step: int) -> None:
        self._log({key: self._wandb.Table(columns=["reward", "prompt", "response"], data=rows)}, step)

    def _log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def _close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


@registry.register("logger", "wandb")
def _wandb_logger(place: Place) -> WandbLogger:
    return WandbLogger(place)
