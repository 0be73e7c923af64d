"""What a run's MLflow record says about where it came from and what it made.

- MLflow's own source tags (`mlflow.source.name`, `mlflow.source.type`, `mlflow.user`, and `mlflow.source.git.commit`,
  `.branch`, `.repoURL` where the working directory is a git checkout): what the runs list's "Source" column and
  the run page's git commit show. MlflowClient.create_run sets none of them (only `mlflow.start_run` does).
- The prompt sets as MLflow datasets, the run's inputs (context `train` / `validation`): name, source, digest and
  row count on the run page; a changed prompt file shows as a changed digest.
- The final LoRA as an MLflow logged model (the run's output): the folder `diffrl export` writes, with the base
  model recorded, which the UI's "Register model" (or `mlflow.register_model("models:/<model id>", NAME)`) turns
  into a model-registry version.
"""

from __future__ import annotations

import getpass
import os
import subprocess
import tempfile
import warnings
from typing import Any

import pandas as pd
from mlflow.data import from_pandas
from mlflow.data.sources import CodeDatasetSource, LocalArtifactDatasetSource
from mlflow.entities import DatasetInput, InputTag, LoggedModelOutput, LoggedModelStatus
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from diffrl.engines.handle import EngineHandle
from diffrl.engines.numbering import step_number
from diffrl.engines.redact import redact_text
from diffrl.engines.step.update import checkpoint_dir
from diffrl.engines.store.prompts import PromptRecord
from diffrl.engines.train.export import export_checkpoint
from diffrl.flows.build import load_prompts, prompt_file, resolve_model_path

LORA_MODEL_NAME = "lora"  # the logged model's name on the run page
LORA_MODEL_TYPE = "diffusers-lora"  # what a registry user filters on: pipe.load_lora_weights(<the model's folder>)


def _git(cwd: str, *args: str) -> str:
    """`git -C cwd ARGS` (stripped), or "" when cwd is not a checkout or git is missing (5 s at most)."""
    try:
        out = subprocess.run(["git", "-C", cwd, *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def source_tags(config: str | None, *, deployment: str | None = None, cwd: str | None = None) -> dict[str, str]:
    """MLflow's source tags for a `diffrl train CONFIG` (source type LOCAL) or a Prefect deployment run (JOB,
    named flow/deployment as `prefect deployment run` names it), with the git tags of the working directory's
    checkout (none outside one); a remote's credentials are replaced by ***."""
    tags = {
        "mlflow.source.type": "JOB" if deployment else "LOCAL",
        "mlflow.source.name": deployment or f"diffrl train {config or 'quickstart'}",
    }
    try:
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):  # no user name for this uid (some containers)
        pass
    cwd = cwd or os.getcwd()
    commit = _git(cwd, "rev-parse", "HEAD")
    if commit:
        tags["mlflow.source.git.commit"] = commit
        branch = _git(cwd, "rev-parse", "--abbrev-ref", "HEAD")
        if branch and branch != "HEAD":  # "HEAD": a detached checkout has no branch
            tags["mlflow.source.git.branch"] = branch
        remote = _git(cwd, "config", "--get", "remote.origin.url")
        if remote:
            tags["mlflow.source.git.repoURL"] = redact_text(remote)  # https://user:TOKEN@host: no TOKEN
    return tags


def prompt_dataset(records: list[PromptRecord], source: str, *, context: str, seed: int | None = None) -> DatasetInput:
    """A prompt set as an MLflow dataset input: one row per prompt (uid, prompt, ground_truth); its source is the
    prompt file (a local path) or, for `generator:<name>` and remote files, a description of where it came from."""
    frame = pd.DataFrame(
        {
            "uid": [r.uid for r in records],
            "prompt": [r.prompt for r in records],
            "ground_truth": [r.ground_truth for r in records],
        }
    )
    if source.startswith("generator:"):
        origin = CodeDatasetSource({"diffrl.prompts": source, "diffrl.seed": str(seed)})
    elif "://" not in source and os.path.exists(prompt_file(source)):
        origin = LocalArtifactDatasetSource(os.path.abspath(prompt_file(source)))
    else:
        origin = CodeDatasetSource({"diffrl.prompts": source})
    with warnings.catch_warnings():  # MLflow warns that a pandas frame may hold integer columns with missing values
        warnings.simplefilter("ignore")
        dataset = from_pandas(frame, source=origin, name=os.path.basename(source) if "/" in source else source)
    return DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])


def log_lora_model(
    client: MlflowClient, run_id: str, experiment_id: str, checkpoint: str, *, base_model: str, step: int
) -> str:
    """Export `checkpoint`'s LoRA as `diffrl export` does (pytorch_lora_weights.safetensors with the base model in
    its LoRA config, diffrl_export.json) and log it as the run's logged model "lora" at MLflow step `step`; returns
    its model id."""
    with tempfile.TemporaryDirectory(prefix="diffrl-lora-") as folder:
        done = export_checkpoint(checkpoint, folder, base_model=base_model, say=lambda _: None)
        model = client.create_logged_model(
            experiment_id,
            name=LORA_MODEL_NAME,
            source_run_id=run_id,
            params={"base_model": base_model, "checkpoint": done.checkpoint, "diffrl_step": str(step)},
            model_type=LORA_MODEL_TYPE,
        )
        client.log_model_artifacts(model.model_id, folder)
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    return model.model_id


def deployment_name() -> str | None:
    """'<flow>/<deployment>' when this flow run belongs to a Prefect deployment (a worker runs it), else None."""
    from prefect.runtime import deployment, flow_run

    return f"{flow_run.flow_name}/{deployment.name}" if deployment.id else None


def base_model(cfg: Any) -> str:
    """What `DiffusionPipeline.from_pretrained` takes for the run's base model: the config's model.path resolved
    (`reference:`/`tiny:` become their local folder, made absolute), or a Hub id as given."""
    path = resolve_model_path(cfg.model.path, seed=cfg.model.tiny_seed)
    return os.path.abspath(path) if os.path.isdir(path) else path


def prompt_inputs(engines: EngineHandle) -> list[DatasetInput]:
    """The run's prompt sets as MLflow dataset inputs: the training prompts (online runs) and the validation
    prompts the run scores."""
    cfg = engines.config
    inputs = []
    if cfg.data.sample_source == "online":
        sampler = getattr(engines, "prompts", None)  # Ray mode: the actors hold it, so it is loaded here
        records = sampler.dataset.records if sampler is not None else None
        if records is None:
            records = load_prompts(cfg.data.train, cfg.data, seed=cfg.run.seed).records
        inputs.append(prompt_dataset(records, cfg.data.train, context="train", seed=cfg.run.seed))
    if engines.val_prompts:  # without data.val, the first training prompts (build.build_engines)
        source, seed = (cfg.data.val, cfg.run.seed + 10_000) if cfg.data.val else (cfg.data.train, cfg.run.seed)
        inputs.append(prompt_dataset(engines.val_prompts, source, context="validation", seed=seed))
    return inputs


def log_final_weights(engines: EngineHandle, tracker: Any, step: int) -> None:
    """The final weights into MLflow: a diffusion LoRA run's LoRA as the run's logged model "lora" (registrable, base
    model recorded); a full fine-tuning run's checkpoint folder (DCP shards), or an autoregressive LoRA run's (its
    PEFT adapter under lora/), as the artifact final_checkpoint."""
    cfg = engines.config
    path = checkpoint_dir(cfg.run_dir, step)
    if not os.path.isdir(path):  # a remote run folder (s3://...): the weights stay there
        return
    if cfg.train.lora and cfg.algorithm.needs.data != "tokens":  # a causal LM's LoRA: a PEFT folder, logged below
        tracker.log_lora(path, base_model=base_model(cfg), step=step_number(step))  # MLflow's step of that step
    else:
        tracker.log_artifact(path, "final_checkpoint")
