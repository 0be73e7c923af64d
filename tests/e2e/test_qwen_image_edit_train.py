"""`diffrl train` of the shipped Qwen-Image-Edit recipe on the tiny Qwen-Image-Edit on the CPU: FlowGRPO, the
shipped recolour prompts (input images by reference), the shapes_edit rule reward; the LoRA moves."""

from __future__ import annotations

import json

import lance
import pytest
from e2e_settings import TINY_RECIPE, trained_lora

from diffrl.flows.train import train

# 2 steps, 4 denoising steps at 64x64 (the reward's scene size), guidance 1 (true CFG with the negative prompt encoded
# with each input image is tests/engines/rollout/test_rollout_edit.py's); input images resized to 128x128 (upstream:
# 1024x1024) to keep it fast.
TINY_EDIT = TINY_RECIPE + [
    "model.path=tiny:qwen_image_edit",
    "model.condition_area=16384",
    "data.train=data/shapes_edit.jsonl",
    "run.steps=2",
    "algorithm.window={kind: random_start, size: 2, start_range: [0, 2]}",
    "rollout.num_inference_steps=4",
    "rollout.height=64",
    "rollout.guidance_scale=1.0",
    "rollout.width=64",
]


@pytest.mark.slow  # 58 s on the 2-core machine at load average ~7 (other test runs at once)
def test_flow_grpo_on_tiny_qwen_image_edit_trains_the_lora(workdir):
    result = train(config="qwen_image_edit_flow_grpo", overrides=TINY_EDIT)
    assert result["last_step"] == 2
    trained_lora("runs/qwen-image-edit-flow-grpo", 2)
    rows = lance.dataset("runs/qwen-image-edit-flow-grpo/trajectories.lance").to_table(columns=["metadata"])
    images = {json.loads(m)["image"] for m in rows.column("metadata").to_pylist()}
    assert len(images) >= 2 and all(p.endswith(".png") and "data/shapes_edit/" in p for p in images)
