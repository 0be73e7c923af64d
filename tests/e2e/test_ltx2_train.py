"""`diffrl train` of the shipped LTX-2 recipe on the tiny "ltx2" on the CPU, with FlowGRPO (the recipe's CPS window)
and DanceGRPO: the packed video + audio latents go through rollout, storage, replay and the LoRA update, with image
rewards scoring the video frames and av_sync scoring the video with its audio track (its stored value is the closed
form of the stored video and audio)."""

from __future__ import annotations

import json
import math

import lance
import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from diffrl.engines.reward.av_sync import sync_lag
from diffrl.engines.store.trajectories import TrajectoryStore
from diffrl.engines.train.checkpoint import lora_file_name
from diffrl.flows.train import train

RUN = "runs/ltx2-flow-grpo"
PROMPTS = ("a red ball rolls to the left", "the sun sets over the sea")
# 2 prompts x 2 videos, 4 denoising steps at 64x64x9 (2 x 2 x 2 video tokens, 9 latent audio frames), no CFG; rewards
# that need no weights score the frames
TINY = [
    "model.path=tiny:ltx2",
    "model.dtype=fp32",
    "model.device=cpu",
    "data.train=prompts.jsonl",
    "data.val=null",
    "data.num_val_prompts=0",
    "reward.components=[{name: jpeg_compressibility}, {name: temporal_consistency, weight: 0.2}, "
    "{name: av_sync, weight: 0.5}]",
    "run.checkpoint_every=1",
    "run.validate_every=0",
    "run.log_images=0",
    "rollout.num_inference_steps=4",
    "rollout.height=64",
    "rollout.width=64",
    "rollout.num_frames=9",
    "rollout.max_sequence_length=32",
    "rollout.group_size=2",
    "rollout.prompts_per_step=2",
    "rollout.chunk_size=4",
    "rollout.batch_size=4",
    "train.lora_rank=4",
    "train.lora_alpha=8",
    "train.lr=1.0e-3",
    "train.mini_batch_prompts=2",
    "train.micro_batch_size=2",
    "train.gradient_checkpointing=false",
]


@pytest.mark.parametrize(
    "overrides",
    [["algorithm.window.start_range=[0, 2]"], ["algorithm=dance_grpo"]],
    ids=["flow_grpo", "dance_grpo"],
)
def test_ltx2_recipe_trains_on_packed_video_and_audio(workdir, overrides, capfd):
    with open("prompts.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in PROMPTS)
    result = train(config="ltx2_flow_grpo", overrides=TINY + ["run.steps=1"] + overrides)
    assert result["last_step"] == 1
    err = capfd.readouterr().err  # the console counts videos
    assert " videos/step)" in err and " videos/s (" in err and "images/s" not in err, err
    step_dir = f"{RUN}/checkpoints/step_1"
    with open(f"{step_dir}/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
    lora = load_file(f"{step_dir}/lora/{lora_file_name('transformer')}")
    # LoRA B starts at zero: it moved, in the video and in the audio branch of the transformer
    for branch in ("attn1", "audio_attn1", "audio_ff"):
        assert any(branch + "." in k and k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())
    mlflow = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    for key in ("critic/rewards/mean", "reward/temporal_consistency", "reward/av_sync", "actor/grad_norm"):
        history = mlflow.get_metric_history(result["mlflow_run_id"], key)
        assert [m.step for m in history] == [1] and math.isfinite(history[0].value), key
    table = lance.dataset(f"{RUN}/trajectories.lance").to_table()
    assert table.num_rows == 4
    # both streams are stored: the frames as images, the waveform as WAV bytes, with the video's fps
    store = TrajectoryStore(f"{RUN}/trajectories.lance")
    traj = store.read_step(0, with_latents=False)
    assert traj.images.shape[:2] == (4, 9) and traj.audio.shape[0] == 4 and traj.fps == 24.0
    _, components, _ = store.read_rewards(0)
    expected = []
    for video, waveform in zip(traj.images.numpy(), traj.audio.numpy()):
        lag, _, max_lag = sync_lag(video, waveform, traj.sample_rate, traj.fps, max_lag_s=0.5)
        expected.append(math.nan if lag is None else 1.0 - abs(lag) / max_lag)
    assert np.allclose(components["av_sync"].numpy(), expected, equal_nan=True), (components["av_sync"], expected)
    assert not all(math.isnan(e) for e in expected)
