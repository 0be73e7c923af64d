"""MLflow for a run: one MLflow run per diffrl run name, continued on resume (no gaps, no duplicates)."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
import sqlite3
import subprocess
import tempfile
import uuid
from importlib import metadata

import mlflow
import numpy as np
import yaml
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_IMAGES
from PIL import Image, ImageDraw

from diffrl.engines.redact import redact, redact_text
from diffrl.engines.step.background import Background
from diffrl.engines.store import fs
from diffrl.flows.errors import RunFailure, cause, one_line
from diffrl.flows.mlflow_template import seed_sqlite_store
from diffrl.models.wav import write_wav

log = logging.getLogger("diffrl")


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI when set, else sqlite:///mlflow.db in the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{os.path.abspath('mlflow.db')}")


def open_tracking_store() -> None:
    """Open the tracking store (creating and migrating a new sqlite database takes seconds), so the run's Tracker
    finds it ready; `diffrl train` does this while the model loads, the flow again for a run without the command."""
    _open_store(tracking_uri())


@functools.cache
def _open_store(uri: str) -> None:
    # once per store and process: the command's early open and the flow's are then one
    seed_sqlite_store(uri)  # a new database: a copy of a migrated one (diffrl/flows/mlflow_template.py)
    try:
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as e:
        damaged = cause(e, sqlite3.DatabaseError)
        if damaged is None or isinstance(damaged, sqlite3.OperationalError):  # locked, busy: not damage
            raise
        where = uri.removeprefix("sqlite:///")
        raise RunFailure(
            f"the MLflow database {redact_text(where)} is damaged ({damaged}): restore it from a backup, or set "
            "MLFLOW_TRACKING_URI to another database"
        ) from e


def mark_failed(state_path: str, status: str = "FAILED") -> None:
    """Mark the MLflow run named in a run's run.json (if it has one yet) FAILED (or `status`: KILLED, interrupted): a
    failure before the Tracker was built, or around it. A failure to reach MLflow is logged, not raised over the run's
    own error."""
    try:
        run_id = fs.read_json(state_path).get("mlflow_run_id")
    except (OSError, ValueError):
        return
    if not run_id:
        return
    try:
        MlflowClient(tracking_uri=tracking_uri()).set_terminated(run_id, status=status)
    except Exception as e:  # noqa: BLE001 - the run's own error is the one to see
        log.error("could not mark MLflow run %s %s: %s", run_id, status, one_line(str(e)))


def _flatten(data: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return out


# The params of a run: what tells runs apart in MLflow's runs table, its compare view and above each image of the
# experiment's charts (all ~130 config keys there push the images out of their cards). config.yaml holds the rest.
KEY_PARAMS = (
    "algorithm.name",
    "model.path",
    "reward.components",
    "data.train",
    "rollout.prompts_per_step",
    "rollout.group_size",
    "rollout.num_inference_steps",
    "rollout.height",
    "rollout.width",
    "train.lr",
    "train.lora_rank",
    "run.steps",
    "run.seed",
)


def run_params(config: dict, file_config: dict | None) -> dict[str, str]:
    """The flattened `config` keys in KEY_PARAMS, and every key whose value differs from `file_config`'s (the
    config file without the run's overrides: what the user changed for this run)."""
    flat = _flatten(config)
    given = _flatten(file_config) if file_config is not None else flat
    return {key: value for key, value in flat.items() if key in KEY_PARAMS or given.get(key) != value}


def _git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return (
            subprocess.run(
                ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


EXPERIMENT_KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"


class Tracker:
    """Owns the MLflow run of a diffrl run (run.loggers `mlflow`, diffrl/flows/loggers.py); its id is kept in
    runs/<name>/run.json, so a resumed run continues it.

    Writes (metrics, images, tags, params, artifacts) go through one background thread in call order, so the
    training loop never waits for the tracking database; `wait` and `finish` wait for them.
    """

    def __init__(self, *, experiment: str, run_name: str, state_path: str):
        self._writes = Background("tracker")
        # an explicit client, not mlflow.set_tracking_uri: that exports MLFLOW_TRACKING_URI, so a later
        # run in the same process from another working directory would log into this run's database
        self.uri = tracking_uri()
        seed_sqlite_store(self.uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.state_path = state_path
        state = self._read_state()
        exp = self.client.get_experiment_by_name(experiment)
        experiment_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        self.experiment_id = experiment_id
        if (exp.tags if exp else {}).get(EXPERIMENT_KIND_TAG) != MODEL_TRAINING:
            # MLflow 3 opens an experiment without a kind on its GenAI (traces) pages; ours is model training
            self.client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
        if state.get("mlflow_run_id"):
            self.run_id = state["mlflow_run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            state["mlflow_run_id"] = self.run_id
            self._write_state(state)

    def _read_state(self) -> dict:
        return fs.read_json(self.state_path) if fs.exists(self.state_path) else {}

    def _write_state(self, state: dict) -> None:
        fs.write_json(self.state_path, state, indent=2)  # run.json may be on an object store (run.root a URI)

    def log_config(self, config: dict, file_config: dict | None = None) -> None:
        """The run's config as the artifact config.yaml and, as params, `run_params` (the key ones and what differs
        from `file_config`, the config file's own values), secrets replaced by *** (diffrl/engines/redact.py:
        storage_options keys, URL credentials, tokens)."""
        params = run_params(redact(config), redact(file_config) if file_config is not None else None)
        self._writes.submit(0, "MLflow config", self._log_config, redact(config), params)

    def _log_config(self, config: dict, params: dict[str, str]) -> None:
        existing = self.client.get_run(self.run_id).data.params
        new = {k: v[:6000] for k, v in params.items() if k not in existing}
        if new:
            self.client.log_batch(self.run_id, params=[mlflow.entities.Param(k, v) for k, v in new.items()])
        self.client.log_text(self.run_id, yaml.safe_dump(config, sort_keys=False), "config.yaml")

    def log_config_change(self, config: dict, step: int, changes: list[str]) -> None:
        """A config changed on resume, in effect from step `step`: MLflow params cannot be overwritten (they keep the
        values the run first started with), so the new config is the artifact config/step_<k>.yaml, and the tags
        diffrl.config_changed_at_step and diffrl.config_changes say when and what (the latest change)."""
        text, name = yaml.safe_dump(config, sort_keys=False), f"config/step_{step}.yaml"
        self._writes.submit(0, "MLflow config change", self.client.log_text, self.run_id, text, name)
        tags = {"diffrl.config_changed_at_step": str(step), "diffrl.config_changes": "; ".join(changes)[:5000]}
        self._writes.submit(0, "MLflow config change tags", self._set_tags, tags)

    def set_tags(self, tags: dict[str, str]) -> None:
        self._writes.submit(0, "MLflow tags", self._set_tags, tags)

    def _set_tags(self, tags: dict[str, str]) -> None:
        base = {"diffrl.version": _version(), "git.commit": _git_commit()}
        entries = [mlflow.entities.RunTag(key, redact_text(str(value))) for key, value in {**base, **tags}.items()]
        self.client.log_batch(self.run_id, tags=entries)

    def logged(self) -> tuple[int, dict[str, float]]:
        """The last step with perf/time_per_step in this MLflow run (0: none) and the val/* values at step 0 (the
        validation before training): what MLflow knows of a run that has no runs/<name>/logged.json yet, one an
        older diffrl started (diffrl/flows/loggers.py)."""
        steps = [int(m.step) for m in self.client.get_metric_history(self.run_id, "perf/time_per_step")]
        before = {}
        for key in [k for k in self.client.get_run(self.run_id).data.metrics if k.startswith("val/")]:
            values = [m.value for m in self.client.get_metric_history(self.run_id, key) if m.step == 0]
            if values:
                before[key] = values[-1]
        return max(steps, default=0), before

    def log_values(self, metrics: dict[str, float], step: int) -> None:
        """Log metrics at `step`. NaN and infinite values are logged as such (MLflow stores them): a loss that went
        NaN must show, not vanish."""
        entries = [mlflow.entities.Metric(k, float(v), _now_ms(), step) for k, v in sorted(metrics.items())]
        for i in range(0, len(entries), 500):
            self._writes.submit(step, "MLflow metrics", self._log_batch, entries[i : i + 500])

    def _log_batch(self, entries: list) -> None:
        self.client.log_batch(self.run_id, metrics=entries)

    def log_images(self, images_BHW3: np.ndarray, captions: list[str], key: str, step: int) -> None:
        """A captioned grid of `images_BHW3` under `key` at `step` (MLflow's stepped images: the UI's image card
        has a step slider, and shows the grid at its own size). The grid is drawn on the writer thread, off the
        training loop (~16 ms for 16 images)."""
        self._writes.submit(step, f"MLflow image {key} step {step}", self._log_images, images_BHW3, captions, key, step)

    def _log_images(self, images_BHW3: np.ndarray, captions: list[str], key: str, step: int) -> None:
        # The files MlflowClient.log_image(key=, step=) writes, except the "+compressed" one that the run page's
        # image card shows: log_image makes it 256 px wide (a 1024-px grid's captions cannot be read), here it is the
        # grid itself, so the card and its enlarged view show every sample at its logged size.
        grid = Image.fromarray(image_grid(images_BHW3, captions))
        stem = f"{key.replace('/', '~')}+step+{step}+timestamp+{_now_ms()}+{uuid.uuid4()}"
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, f"{stem}.png")
            grid.save(path)
            shutil.copyfile(path, os.path.join(folder, f"{stem}+compressed.png"))
            self.client.log_artifacts(self.run_id, folder, "images")
        self.client.set_tag(self.run_id, MLFLOW_LOGGED_IMAGES, "True")

    def log_audio(self, waveforms_BCT: np.ndarray, sample_rate: int, captions: list[str], key: str, step: int) -> None:
        """Audio clips at `step` as the artifacts `audio/<key>/step_<k>/<i>.wav` (16-bit PCM WAV: MLflow's artifact
        view plays them) with their captions (reward and prompt) in `captions.txt` beside them."""
        what = f"MLflow audio {key} step {step}"
        self._writes.submit(step, what, self._log_audio, waveforms_BCT, sample_rate, captions, key, step)

    def _log_audio(self, waveforms_BCT: np.ndarray, sample_rate: int, captions: list[str], key: str, step: int):
        with tempfile.TemporaryDirectory() as folder:
            for i, waveform_CT in enumerate(waveforms_BCT):
                write_wav(os.path.join(folder, f"{i:02d}.wav"), waveform_CT, sample_rate)
            lines = [f"{i:02d}.wav  {text}" for i, text in enumerate(captions)]
            with open(os.path.join(folder, "captions.txt"), "w") as f:
                f.write("\n".join(lines) + "\n")
            self.client.log_artifacts(self.run_id, folder, f"audio/{key}/step_{step:06d}")

    def log_responses(
        self, prompts: list[str], responses: list[str], rewards: list[float], key: str, step: int
    ) -> None:
        """A token run's samples at `step` as the text artifact `<key>/step_<k>.txt`: reward, prompt, response."""
        lines = [f"{caption(p, r)}\n    -> {text!r}" for p, text, r in zip(prompts, responses, rewards)]
        name = f"{key}/step_{step:06d}.txt"
        self._writes.submit(step, f"MLflow {name}", self.client.log_text, self.run_id, "\n".join(lines) + "\n", name)

    def log_inputs(self, datasets: list) -> None:
        """The run's input datasets (mlflow.entities.DatasetInput; MLflow keeps one of each per run)."""
        self._writes.submit(0, "MLflow inputs", self.client.log_inputs, self.run_id, datasets)

    def log_lora(self, checkpoint: str, *, base_model: str, step: int) -> None:
        """The checkpoint's LoRA as the run's logged model "lora" (diffrl/flows/provenance.log_lora_model)."""
        from diffrl.flows.provenance import log_lora_model

        log = functools.partial(log_lora_model, base_model=base_model, step=step)
        self._writes.submit(step, "MLflow LoRA model", log, self.client, self.run_id, self.experiment_id, checkpoint)

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        self._writes.submit(
            0, f"MLflow artifact {local_path}", self.client.log_artifact, self.run_id, local_path, artifact_path
        )

    def wait(self, step: int) -> None:
        """Wait for the writes queued for steps <= `step` (raises the first that failed)."""
        self._writes.wait(step)

    def flush(self) -> None:
        """Wait for every queued write (raises the first that failed)."""
        self._writes.flush()

    def finish(self, status: str = "FINISHED") -> None:
        """Wait for the queued writes, then mark the run terminated (also after a failed write, which is raised
        unless the run failed already: then the run's own error is the one to see)."""
        try:
            self._writes.flush()
        except Exception as e:  # noqa: BLE001
            if status == "FINISHED":
                raise
            log.error("MLflow writes failed too: %s", e)
        finally:
            self.client.set_terminated(self.run_id, status=status)
            self._writes.close()

    @property
    def ui_hint(self) -> str:
        return f"diffrl ui --backend-store-uri {redact_text(self.uri)}  (run id {self.run_id})"


def image_grid(
    images_BHW3: np.ndarray, captions: list[str] | None = None, *, cols: int = 4, min_tile: int = 256
) -> np.ndarray:
    """Tile uint8 images (B, H, W, 3) into one grid (first frame of videos), each enlarged (nearest, an integer
    factor) to at least `min_tile` pixels wide so a 64x64 sample is visible, with its caption under it."""
    if images_BHW3.ndim == 5:
        images_BHW3 = images_BHW3[:, 0]
    b, h, w, c = images_BHW3.shape
    scale = max(1, -(-min_tile // w))
    th, tw = h * scale, w * scale
    band = 30 if captions else 0
    cols = min(cols, b)
    rows = -(-b // cols)
    grid = Image.new("RGB", (cols * tw, rows * (th + band)), "white")
    draw = ImageDraw.Draw(grid)
    for i in range(b):
        r, q = divmod(i, cols)
        tile = Image.fromarray(images_BHW3[i]).resize((tw, th), Image.NEAREST)
        grid.paste(tile, (q * tw, r * (th + band)))
        if captions:
            for k, line in enumerate(_wrap(captions[i], chars=max(8, tw // 7))[:2]):
                draw.text((q * tw + 3, r * (th + band) + th + 2 + 13 * k), line, fill="black")
    return np.asarray(grid)


def _wrap(text: str, chars: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > chars:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return [*lines, line] if line else lines


def caption(prompt: str, reward: float) -> str:
    """A grid caption: the reward, then the prompt."""
    return f"{'excluded' if math.isnan(reward) else f'{reward:.2f}'}: {prompt}"


def _version() -> str:
    try:
        return metadata.version("diffrl")
    except metadata.PackageNotFoundError:
        return "unknown"


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)
