"""What a user sees from the `diffrl` command itself, run as a subprocess: `--version`, and the one-line errors of
a mistyped config key."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import diffrl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _diffrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diffrl", *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )


def test_version_prints_the_package_version_and_exits_0():
    proc = _diffrl("--version")
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"diffrl \d+\.\d+\.\d+\S*\n", proc.stdout), proc.stdout


def test_package_version_is_the_one_pyproject_declares():
    # `diffrl --version` falls back to diffrl.__version__ when the package is not installed
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        declared = re.search(r'^version = "([^"]+)"', f.read(), re.MULTILINE).group(1)
    assert diffrl.__version__ == declared


def test_mistyped_key_suggests_the_dotted_key_with_its_section():
    proc = _diffrl("config", "show", "train.lrr=1")
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "unknown config key 'train.lrr'; did you mean 'train.lr'?" in line, line


def test_serve_judge_takes_the_model_names_configs_take():
    """MODEL_DIR may be reference:<name> or tiny:<arch>. With an interpreter that has no vLLM the server then fails
    to start (exit 1, its log's tail); a name that resolves to nothing is bad input (exit 2), reported before any
    vLLM venv would be made."""
    env = {**os.environ, "DIFFRL_VLLM_PYTHON": sys.executable}
    proc = subprocess.run(
        [sys.executable, "-m", "diffrl", "serve-judge", "reference:shapes-thinker", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 1 and "No module named 'vllm'" in proc.stderr, proc.stderr[-2000:]
    proc = subprocess.run(
        [sys.executable, "-m", "diffrl", "serve-judge", "reference:nope"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "DIFFRL_VLLM_PYTHON": "/nonexistent/python"},
    )
    assert proc.returncode == 2 and "no shipped reference model 'nope'" in proc.stderr, proc.stderr
