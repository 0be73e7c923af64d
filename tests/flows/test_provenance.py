"""MLflow's own source tags of a run (diffrl/flows/provenance.py): what the runs list's Source column shows."""

from __future__ import annotations

import subprocess

from diffrl.flows.provenance import source_tags


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
