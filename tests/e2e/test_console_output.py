"""What `diffrl train` prints by default: its own progress lines only (issue 28, item 4); -v brings the libraries'
output back."""

from __future__ import annotations

import os
import subprocess
import sys

from e2e_settings import TINY

from diffrl.flows.cli import quiet_libraries


def test_default_console_has_only_diffrl_lines(workdir):
    """The whole run through the real CLI in a fresh process: no Prefect, MLflow, diffusers/transformers bars or
    peft warnings, on stdout or stderr (the quickstart printed about 15 such lines before)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_LOGGING", "MLFLOW_LOGGING", "DIFFRL_V"))}
    env.pop("TRANSFORMERS_VERBOSITY", None)
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "diffrl", "train", *TINY, "run.steps=1", "algorithm=diffusion_nft"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines and all(line.startswith("[diffrl] ") for line in lines), "\n".join(lines)
    assert any("step 1/1" in line for line in lines)


def test_verbose_restores_the_libraries_levels(monkeypatch):
    for key in ("PREFECT_LOGGING_LEVEL", "MLFLOW_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY", "DIFFRL_VERBOSE"):
        monkeypatch.delenv(key, raising=False)
    quiet_libraries(verbose=True)
    assert os.environ["PREFECT_LOGGING_LEVEL"] == "INFO" and os.environ["MLFLOW_LOGGING_LEVEL"] == "INFO"
    assert os.environ["DIFFRL_VERBOSE"] == "1"
    monkeypatch.setenv("PREFECT_LOGGING_LEVEL", "DEBUG")  # a level the user exported wins
    quiet_libraries(verbose=False)
    assert os.environ["PREFECT_LOGGING_LEVEL"] == "DEBUG"
