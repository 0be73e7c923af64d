"""The hacking guard in whole runs of the quickstart's own model (shapes-small, at one step's worth of 8 images): a
reward that pays for dark images darkens the held-out probe images until the bound on their brightness stops the run
with one line, a finished run that resumes with a looser bound; the quickstart's own reward (geneval_lite) leaves
them as they were.

Measured on the 2-core CPU at seed 0 (probes of 2 prompts x 2 images, every 2 steps): guard/probe/brightness_mean
0.9825 before training, 0.9737 after 2 steps of the dark reward, 0.9822 after 2 steps of geneval_lite. The per-step
statistics of the rollouts moved alike in both runs (new prompts each step): the probes are what tells them apart."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from diffrl.flows.train import train

SMALL = [
    "run.log_images=0",
    "run.checkpoint_every=2",
    "data.num_val_prompts=0",
    "rollout.group_size=4",
    "rollout.prompts_per_step=2",
    "rollout.chunk_size=8",
    "rollout.batch_size=8",
    "train.mini_batch_prompts=2",
    "train.micro_batch_size=8",
    "run.guard.probe_prompts=generator:shapes",
    "run.guard.num_probe_prompts=2",
    "run.guard.probe_every=2",
    "run.guard.bounds=[{metric: guard/probe/brightness_mean, max_drift: 0.006}]",
]
DARK = "reward.components=[{name: 'my_rewards:brightness', options: {scale: -1.0}}]"  # pays for dark images


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def test_a_dark_reward_trips_the_guard_and_the_quickstart_reward_does_not(workdir, user_reward_modules, capsys):
    dark = train(config=None, overrides=SMALL + [DARK, "run.name=dark", "run.steps=3"])
    err = capsys.readouterr().err
    stops = [line for line in err.splitlines() if "hacking guard" in line]
    assert len(stops) == 1 and stops[0].startswith("[diffrl] hacking guard: stopped after step 2: ")
    assert "guard/probe/brightness_mean 0.97" in stops[0] and "past its bound 0.006 (run.guard.bounds)" in stops[0]
    assert "step 3/3" not in err and dark["last_step"] == 2  # step 2 committed, step 3 never started
    with open("runs/dark/checkpoints/latest.json") as f:
        assert json.load(f)["step"] == 2
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    run = client.get_run(dark["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["diffrl.guard_stop"] == stops[0].removeprefix("[diffrl] ")
    probes = _history(client, dark["mlflow_run_id"], "guard/probe/brightness_mean")
    assert [step for step, _ in probes] == [0, 2] and probes[0][1] - probes[1][1] > 0.006  # darker
    steps = _history(client, dark["mlflow_run_id"], "guard/colourfulness_mean")
    assert [step for step, _ in steps] == [1, 2]  # every step's own statistics
    with open("runs/dark/guard.json") as f:
        first = json.load(f)["first"]
    assert first["guard/probe/brightness_mean"] == {"value": probes[0][1], "step": 0}

    # a stopped run resumes like any other: the same command with a looser bound trains step 3 and finishes
    looser = [o.replace("max_drift: 0.006", "max_drift: 0.5") for o in SMALL]
    resumed = train(config=None, overrides=looser + [DARK, "run.name=dark", "run.steps=3"])
    err = capsys.readouterr().err
    assert resumed["last_step"] == 3 and "resuming after step 2" in err and "hacking guard" not in err
    with open("runs/dark/guard.json") as f:
        assert json.load(f)["first"] == first  # still compared with the probe before training

    normal = train(config=None, overrides=SMALL + ["run.name=normal", "run.steps=2"])
    assert normal["last_step"] == 2 and "hacking guard" not in capsys.readouterr().err
    probes = _history(client, normal["mlflow_run_id"], "guard/probe/brightness_mean")
    assert [step for step, _ in probes] == [0, 2] and probes[1][1] == pytest.approx(probes[0][1], abs=0.002)
