"""The disk estimate `diffrl train` prints before a run, against the closed form."""

from __future__ import annotations

from diffrl.configs.schema import load_experiment
from diffrl.engines.step.retention import describe_disk, disk_estimate


def test_disk_estimate_closed_form():
    # shapes_flow_grpo: 512 samples a step, FlowGRPO's all-but-last window of its 4 steps (3 steps, 4 stored
    # states), 64x64 images, 600 steps
    cfg = load_experiment("shapes_flow_grpo", [])
    latent = 4 * 64 * 64
    est = disk_estimate(cfg, latent)
    assert est["latents_per_step"] == 512 * 4 * latent * 4
    assert est["rows_per_step"] == 512 * (1024 + 64 * 64 * 3)
    held = 2 + 1 + 10  # kept steps, the step in flight, and those waiting for the next compaction
    assert est["latent_steps_held"] == held
    assert est["total"] == 600 * est["rows_per_step"] + held * est["latents_per_step"]
    keep_all = disk_estimate(load_experiment("shapes_flow_grpo", ["run.keep_latents_steps=-1"]), latent)
    assert keep_all["total"] == 600 * (keep_all["rows_per_step"] + keep_all["latents_per_step"])
    line = describe_disk(cfg, latent)
    assert line.startswith("disk: about 5.8 GB for 600 steps (latents of the last 2 steps kept") and "free" in line
