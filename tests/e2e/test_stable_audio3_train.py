"""`diffrl train` of the shipped Stable Audio 3 recipe on the tiny Stable Audio 3 on the CPU: FlowGRPO on an audio
reward. The trajectory table holds each sample's audio (WAV bytes) and no frames, the stored reward is the loudness
rule's closed form of the stored waveform, MLflow has the step's clips as .wav artifacts, and the LoRA moves."""

from __future__ import annotations

import glob

import lance
import pytest
from e2e_settings import TINY_RECIPE, trained_lora

from diffrl.engines.reward.audio import rms_dbfs, target_score
from diffrl.engines.store.trajectories import TrajectoryStore
from diffrl.flows.train import train
from diffrl.models.wav import decode_wav

RUN = "runs/stable-audio3-flow-grpo"
# 3 denoising steps of 0.25 s clips (2000 stereo samples at the tiny 8 kHz), two clips logged per step; the recipe's
# reward (audio_loudness, target -20 dBFS, tolerance 2 dB, falloff 6 dB)
TINY_SA3 = TINY_RECIPE + [
    "model.path=tiny:stable_audio3",
    "rollout.num_inference_steps=3",
    "rollout.duration=0.25",
    "run.log_images=2",
]


def test_flow_grpo_on_tiny_stable_audio3_stores_scores_and_logs_audio(workdir, capfd):
    result = train(config="stable_audio3_flow_grpo", overrides=TINY_SA3)
    assert result["last_step"] == 1
    err = capfd.readouterr().err  # the console counts clips, not images
    assert "(4 clips/step)" in err and " clips/s (" in err and "images/s" not in err, err
    trained_lora(RUN, 1)

    table = lance.dataset(f"{RUN}/trajectories.lance")
    assert {"audio", "fps"} <= set(table.schema.names)
    rows = table.to_table(columns=["image", "num_frames", "fps"]).to_pydict()
    assert rows["image"] == [None] * 4 and rows["num_frames"] == [0] * 4 and rows["fps"] == [None] * 4

    store = TrajectoryStore(f"{RUN}/trajectories.lance")
    traj = store.read_step(0, with_latents=False)
    assert traj.audio.shape == (4, 2, 2000) and traj.sample_rate == 8000 and traj.images.shape == (4, 0, 0, 3)
    rewards, _, valid = store.read_rewards(0)
    assert bool(valid.all())
    # the reward scored the float waveform; the table keeps it as 16-bit PCM (within 1/65536), so the closed form of
    # the stored audio agrees to far better than 1e-4
    expected = [target_score(abs(rms_dbfs(w.numpy()) - (-20.0)), 2.0, 6.0) for w in traj.audio]
    assert rewards.tolist() == pytest.approx(expected, abs=1e-4)
    assert len(set(expected)) == 4  # four different clips, not one repeated waveform

    clips = sorted(glob.glob("mlruns/**/audio/rollout/step_000001/*.wav", recursive=True))
    assert [c.rsplit("/", 1)[1] for c in clips] == ["00.wav", "01.wav"]
    with open(clips[0], "rb") as f:
        waveform, rate = decode_wav(f.read())
    assert rate == 8000 and waveform.shape == (2, 2000) and abs(waveform).max() > 0.01
