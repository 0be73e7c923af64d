"""`diffrl train` on a prompt file whose rows play audio clips (the tiny Qwen3-Omni Thinker, GRPO, exact-match reward):
the clips travel by path from the dataset through the rollout, the Lance rows and the trainer's replay."""

from __future__ import annotations

import json

import lance
from mlflow.tracking import MlflowClient

from diffrl.flows.train import train

# 2 questions x 2 answers a step in one chunk, 2 steps; the omni quickstart's algorithm and reward
SMALL = [
    "model.path=tiny:qwen3_omni",
    "data.val=null",
    "run.steps=2",
    "run.checkpoint_every=2",
    "run.log_images=0",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.chunk_size=4",
    "rollout.batch_size=4",
    "rollout.max_new_tokens=3",
    "train.mini_batch_prompts=2",
    "train.micro_batch_size=4",
]


def test_a_run_on_audio_prompts_trains_and_stores_the_clips_by_path(workdir, sine_wav):
    (workdir / "data" / "sounds").mkdir(parents=True)
    rows = []
    for i, (freq, answer) in enumerate([(300, "low"), (3000, "high"), (500, "low"), (2000, "high")]):
        sine_wav(f"data/sounds/tone{i}.wav", freq, seconds=0.3 + 0.1 * i)  # workdir is the fixtures' tmp_path
        rows.append({"prompt": "is it high or low?", "audios": [f"sounds/tone{i}.wav"], "ground_truth": answer})
    (workdir / "data" / "tones.jsonl").write_text("\n".join(json.dumps(r) for r in rows))

    result = train(config="omni_quick", overrides=[*SMALL, "data.train=data/tones.jsonl", "run.name=tones"])
    assert result["last_step"] == 2

    stored = lance.dataset(f"{workdir}/runs/tones/trajectories.lance").to_table().to_pylist()
    assert len(stored) == 2 * 4
    clips = {str(workdir / "data" / "sounds" / f"tone{i}.wav") for i in range(4)}
    for row in stored:
        assert len(row["audios"]) == 1 and row["audios"][0] in clips and row["images"] == []
        assert json.loads(row["metadata"])["audios"] == row["audios"]
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("diffrl-omni").experiment_id])[0]
    assert run.info.status == "FINISHED"
    # the trainer replayed the rows with their clips: its log-probs are the rollout's
    assert run.data.metrics["rollout_corr/logprob_abs_diff_max"] < 1e-4
