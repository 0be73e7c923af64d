"""`diffrl train` of the shipped FLUX.1-Kontext recipe on the tiny FLUX.1-Kontext on the CPU: FlowGRPO on the shipped
recolour prompts (input images by reference) with the shapes_edit rule reward; the LoRA moves."""

from __future__ import annotations

import json
import math

import lance
from safetensors.torch import load_file

from diffrl.engines.train.checkpoint import lora_file_name
from diffrl.flows.train import train

# 1 step, 2 prompts x 2 edits, 3 denoising steps at 64x64 (the reward's scene size), input images kept at 64x64
# (upstream: its ~1024x1024 preferred resolutions) to keep it fast.
TINY_KONTEXT = [
    "model.path=tiny:flux_kontext",
    "model.dtype=fp32",
    "model.device=cpu",
    "model.condition_area=4096",
    "data.train=data/shapes_edit.jsonl",
    "data.val=null",
    "data.num_val_prompts=0",
    "run.steps=1",
    "run.validate_every=0",
    "run.checkpoint_every=1",
    "run.log_images=0",
    "rollout.num_inference_steps=3",
    "rollout.height=64",
    "rollout.width=64",
    "rollout.group_size=2",
    "rollout.prompts_per_step=2",
    "rollout.chunk_size=4",
    "rollout.batch_size=4",
    "train.lora_rank=4",
    "train.lora_alpha=8",
    "train.lr=1e-3",
    "train.lora_compute=fp32",
    "train.mini_batch_prompts=2",
    "train.micro_batch_size=4",
]


def test_flow_grpo_on_tiny_flux_kontext_trains_the_lora(workdir):
    result = train(config="flux_kontext_flow_grpo", overrides=TINY_KONTEXT)
    assert result["last_step"] == 1
    step_dir = "runs/flux-kontext-flow-grpo/checkpoints/step_1"
    with open(f"{step_dir}/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
    lora = load_file(f"{step_dir}/lora/{lora_file_name('transformer')}")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())
    rows = lance.dataset("runs/flux-kontext-flow-grpo/trajectories.lance").to_table(columns=["metadata"])
    images = {json.loads(m)["image"] for m in rows.column("metadata").to_pylist()}
    assert len(images) == 2 and all(p.endswith(".png") and "data/shapes_edit/" in p for p in images)
