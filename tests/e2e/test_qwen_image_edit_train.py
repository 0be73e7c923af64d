"""`diffrl train` of the shipped Qwen-Image-Edit recipe on the tiny Qwen-Image-Edit on the CPU: FlowGRPO, the
shipped recolour prompts (input images by reference), the shapes_edit rule reward; the LoRA moves."""

from __future__ import annotations

import json
import math

import lance
import pytest
from safetensors.torch import load_file

from diffrl.engines.train.checkpoint import lora_file_name
from diffrl.flows.train import train

# 2 steps, 2 prompts x 2 edits, 4 denoising steps at 64x64 (the reward's scene size), guidance 1 (true CFG with the
# negative prompt encoded with each input image is tests/engines/rollout/test_rollout_edit.py's); input images
# resized to 128x128 (upstream: 1024x1024) to keep it fast.
TINY_EDIT = [
    "model.path=tiny:qwen_image_edit",
    "model.dtype=fp32",
    "model.device=cpu",
    "model.condition_area=16384",
    "data.train=data/shapes_edit.jsonl",
    "data.val=null",
    "data.num_val_prompts=0",
    "run.steps=2",
    "run.validate_every=0",
    "run.checkpoint_every=1",
    "run.log_images=0",
    "algorithm.window={kind: random_start, size: 2, start_range: [0, 2]}",
    "rollout.num_inference_steps=4",
    "rollout.height=64",
    "rollout.guidance_scale=1.0",
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


@pytest.mark.slow  # 58 s on the 2-core machine at load average ~7 (other test runs at once)
def test_flow_grpo_on_tiny_qwen_image_edit_trains_the_lora(workdir):
    result = train(config="qwen_image_edit_flow_grpo", overrides=TINY_EDIT)
    assert result["last_step"] == 2
    step_dir = "runs/qwen-image-edit-flow-grpo/checkpoints/step_2"
    with open(f"{step_dir}/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
    lora = load_file(f"{step_dir}/lora/{lora_file_name('transformer')}")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())
    rows = lance.dataset("runs/qwen-image-edit-flow-grpo/trajectories.lance").to_table(columns=["metadata"])
    images = {json.loads(m)["image"] for m in rows.column("metadata").to_pylist()}
    assert len(images) >= 2 and all(p.endswith(".png") and "data/shapes_edit/" in p for p in images)
