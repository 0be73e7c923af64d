"""`diffrl train tests/configs/janus_shapes_grpo.yaml` (GRPO on the tiny random Janus's image tokens, CFG group
sampling, geneval_lite on the decoded images) through the whole flow at a tiny size: two steps complete, the token
rows hold 16 image tokens with their log-probs and the decoded image, the rewards are the geneval_lite scores of
those images, MLflow has the reward metrics, and the LoRA weights moved (peft starts lora_B at zero)."""

from __future__ import annotations

import glob
import io
import json

import lance
import numpy as np
import pytest
import torch
from e2e_settings import config_file
from mlflow.tracking import MlflowClient
from PIL import Image
from safetensors.torch import load_file

from diffrl.configs.schema import load_experiment
from diffrl.engines.reward.multi import MultiReward
from diffrl.flows.train import train

# 2 prompts x 4 images a step in one chunk, 2 held-out prompts; 2 steps
SMALL = [
    "run.steps=2",
    "run.checkpoint_every=2",
    "run.log_images=2",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.chunk_size=8",
    "rollout.batch_size=8",
    "train.mini_batch_prompts=2",
    "train.micro_batch_size=8",
    "data.num_generated=32",
    "data.num_val_prompts=2",
]


@pytest.mark.slow  # ~25 s alone on the 2-core CPU (two steps, two validations, Prefect and MLflow)
def test_janus_grpo_trains_on_image_tokens_through_the_flow(workdir, capsys):
    result = train(config=config_file("janus_shapes_grpo"), overrides=SMALL)
    assert result["last_step"] == 2 and 0 <= result["val/reward"] <= 1
    assert "responses/s (" in capsys.readouterr().err

    run_dir = f"{workdir}/runs/janus-shapes-grpo"
    rows = lance.dataset(f"{run_dir}/trajectories.lance").to_table().to_pylist()
    assert len(rows) == 2 * 8 and sorted({r["step"] for r in rows}) == [1, 2]
    rewards = {
        (r["step"], r["group_id"], r["sample_index"]): r["reward"]
        for r in lance.dataset(f"{run_dir}/rewards.lance").to_table().to_pylist()
    }
    images = torch.from_numpy(np.stack([np.asarray(Image.open(io.BytesIO(r["image"]))) for r in rows]))
    assert images.shape == (16, 64, 64, 3)
    for row in rows:
        assert len(row["response_ids"]) == len(row["log_probs"]) == 16 and row["response"] == "<image: 16 tokens>"
        assert all(0 <= t < 256 for t in row["response_ids"]) and all(lp < 0 for lp in row["log_probs"])
    # the stored reward is geneval_lite of the stored (decoded) image
    reward = MultiReward(load_experiment(config_file("janus_shapes_grpo"), []).reward)
    scored = reward(images, [r["prompt"] for r in rows], [json.loads(r["metadata"]) for r in rows])
    stored = torch.tensor([rewards[(r["step"], r["group_id"], r["sample_index"])] for r in rows])
    torch.testing.assert_close(scored.scores, stored)

    lora = load_file(glob.glob(f"{run_dir}/checkpoints/step_2/lora/*.safetensors")[0])
    assert lora and all(".language_model." in k for k in lora)
    assert max(float(v.abs().max()) for k, v in lora.items() if "lora_B" in k) > 0  # zero at the start

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("diffrl-janus").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    metrics = runs[0].data.metrics
    for name in ("critic/rewards/mean", "reward/geneval_lite/accuracy", "actor/pg_loss", "actor/grad_norm"):
        assert name in metrics, name
    # trainer and rollout share the numerics in one process: the replay's log-probs are the rollout's
    assert metrics["rollout_corr/logprob_abs_diff_max"] < 1e-4
    assert metrics["response_length/mean"] == 16 and metrics["response_length/clip_ratio"] == 0  # whole images
    assert sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "val/reward")) == [0, 2]
