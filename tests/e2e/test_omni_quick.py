"""`diffrl train omni_quick` (the shipped Qwen3-Omni Thinker warm start, GRPO, exact-match reward) through the whole
flow at a tiny size, failing in its second step's update and run again: the same Prefect stages, Lance tables, MLflow
names, checkpoints and resume as the diffusion runs (tests/e2e/test_train_flow.py). In one process: the kill variant
of tests/e2e/test_kill_resume.py (two `diffrl` processes) took 72 s here, most of it two interpreters' imports."""

from __future__ import annotations

import json
import os

import lance
import pytest
from mlflow.tracking import MlflowClient

from diffrl.flows.train import train
from diffrl.shapes.questions import scene_questions

# 4 questions x 4 answers a step in 2 chunks, 8 held-out questions; 3 steps, the second one killed in its update.
SMALL = [
    "run.steps=3",
    "run.checkpoint_every=2",
    "run.log_images=2",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.chunk_size=8",
    "rollout.batch_size=8",
    "train.mini_batch_prompts=4",
    "train.micro_batch_size=8",
    "data.num_generated=64",
    "data.num_val_prompts=8",
]


def test_omni_quick_trains_through_the_flow_and_resumes_after_a_failure(workdir, monkeypatch, capsys):
    monkeypatch.setenv("DIFFRL_INJECT_FAULT", "update_actor@2")
    with pytest.raises(Exception, match="injected fault"):
        train(config="omni_quick", overrides=SMALL)
    monkeypatch.delenv("DIFFRL_INJECT_FAULT")
    result = train(config="omni_quick", overrides=SMALL)
    assert result["last_step"] == 3 and 0 <= result["val/reward"] <= 1
    err = capsys.readouterr().err
    assert "resuming after step 1" in err and "responses/s (" in err and "images/s" not in err  # a token run's unit

    run_dir = f"{workdir}/runs/omni-quick"
    rows = lance.dataset(f"{run_dir}/trajectories.lance").to_table().to_pylist()
    assert sorted({(r["step"], r["chunk"]) for r in rows}) == [(s, c) for s in (1, 2, 3) for c in (0, 1)]
    assert len(rows) == 3 * 16  # step 2's chunks were reused, not sampled again
    answers = {r.prompt: r.ground_truth for r in scene_questions(64, 0, None).records}  # generator:shapes_qa_text
    rewards = {
        (r["step"], r["group_id"], r["sample_index"]): r["reward"]
        for r in lance.dataset(f"{run_dir}/rewards.lance").to_table().to_pylist()
    }
    for row in rows:
        truth = json.loads(row["metadata"])["ground_truth"]
        assert truth == answers[row["prompt"]]  # the dataset's answer travelled with the sample
        assert len(row["log_probs"]) == len(row["response_ids"]) >= 1 and row["images"] == []
        reward = rewards[(row["step"], row["group_id"], row["sample_index"])]
        assert reward == float(row["response"].strip().lower().strip(".") == truth), row
    assert row["policy_version"] == 2  # step 3 sampled after two weight syncs, the resume's one included

    assert os.path.exists(f"{run_dir}/checkpoints/step_3/checksums.json")
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("diffrl-omni").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    assert sorted(m.step for m in client.get_metric_history(run_id, "critic/score/mean")) == [1, 2, 3]
    assert sorted(m.step for m in client.get_metric_history(run_id, "val/reward")) == [0, 3]
    metrics = runs[0].data.metrics
    for name in (
        "response_length/mean",
        "actor/entropy",
        "actor/pg_clipfrac",
        "actor/grad_norm",
        "critic/rewards/mean",
    ):
        assert name in metrics, name
    assert 1 <= metrics["response_length/mean"] <= 4 and metrics["actor/entropy"] > 0
    # trainer and rollout share the numerics in one process: the replay's log-probs are the rollout's
    assert metrics["rollout_corr/logprob_abs_diff_max"] < 1e-4
    logged = client.download_artifacts(run_id, "rollout/step_000003.txt", str(workdir))
    assert open(logged).read().count("    -> ") == 2  # run.log_images responses, each under its reward and question
