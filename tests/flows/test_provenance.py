"""MLflow's own source tags of a run (diffrl/flows/provenance.py): what the runs list's Source column shows."""

from __future__ import annotations

import subprocess

from diffrl.flows.provenance import prompt_dataset, source_tags


def _git(cwd, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_source_tags_name_the_command_and_the_working_directorys_commit(tmp_path):
    """`diffrl train CONFIG` is a LOCAL source named after the command; in a git checkout the commit, branch and
    remote are MLflow's git tags; outside one there are none (rather than a made-up value)."""
    outside = source_tags("quickstart", cwd=str(tmp_path))
    assert outside["mlflow.source.type"] == "LOCAL" and outside["mlflow.source.name"] == "diffrl train quickstart"
    assert not any(k.startswith("mlflow.source.git") for k in outside)

    _git(tmp_path, "init", "-q", "-b", "main")
    (tmp_path / "my.yaml").write_text("run: {name: x}\n")
    _git(tmp_path, "add", "my.yaml")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "config")
    _git(tmp_path, "remote", "add", "origin", "https://example.com/team/configs.git")
    tags = source_tags("my.yaml", cwd=str(tmp_path))
    assert tags["mlflow.source.git.commit"] == _git(tmp_path, "rev-parse", "HEAD")
    assert tags["mlflow.source.git.branch"] == "main"
    assert tags["mlflow.source.git.repoURL"] == "https://example.com/team/configs.git"
    assert tags["mlflow.source.name"] == "diffrl train my.yaml"

    job = source_tags("quickstart", deployment="train/nightly", cwd=str(tmp_path))
    assert job["mlflow.source.type"] == "JOB" and job["mlflow.source.name"] == "train/nightly"


def test_a_remotes_credentials_stay_out_of_the_source_tags(tmp_path):
    """A checkout cloned with a token in its remote URL: MLflow's repoURL tag names the remote without it."""
    _git(tmp_path, "init", "-q", "-b", "main")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "--allow-empty", "-m", "x")
    _git(tmp_path, "remote", "add", "origin", "https://user:TOKEN@example.com/x.git")
    tags = source_tags("my.yaml", cwd=str(tmp_path))
    assert tags["mlflow.source.git.repoURL"] == "https://***@example.com/x.git"
    assert not any("TOKEN" in value for value in tags.values())


def test_a_prompt_file_is_a_local_dataset_and_a_generator_names_itself(tmp_path, monkeypatch):
    """The dataset inputs' sources: a shipped prompt file named relative to the package (as the quickstart's data.val
    is) resolves to the file; a generator is described by its name and seed; the digest follows the content."""
    import json

    from diffrl.engines.store.prompts import PromptRecord

    monkeypatch.chdir(tmp_path)  # nothing named data/shapes_heldout.jsonl here: the shipped file is meant
    records = [PromptRecord("a", "two red circles", ground_truth='{"include": []}'), PromptRecord("b", "a square")]
    shipped = prompt_dataset(records, "data/shapes_heldout.jsonl", context="validation")
    assert shipped.dataset.source_type == "local" and shipped.tags[0].value == "validation"
    assert json.loads(shipped.dataset.source)["uri"].endswith("diffrl/data/shapes_heldout.jsonl")
    generated = prompt_dataset(records, "generator:shapes", context="train", seed=0)
    assert json.loads(generated.dataset.source) == {"tags": {"diffrl.prompts": "generator:shapes", "diffrl.seed": "0"}}
    assert json.loads(generated.dataset.profile)["num_rows"] == 2
    assert prompt_dataset(records[:1], "generator:shapes", context="train").dataset.digest != generated.dataset.digest
