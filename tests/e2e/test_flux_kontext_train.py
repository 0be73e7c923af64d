"""`diffrl train` of the shipped FLUX.1-Kontext recipe on the tiny FLUX.1-Kontext on the CPU: FlowGRPO on the shipped
recolour prompts (input images by reference) with the shapes_edit rule reward; the LoRA moves."""

from __future__ import annotations

import json

import lance
from e2e_settings import TINY_RECIPE, trained_lora

from diffrl.flows.train import train

# 3 denoising steps at 64x64 (the reward's scene size), input images kept at 64x64 (upstream: its ~1024x1024
# preferred resolutions) to keep it fast.
TINY_KONTEXT = TINY_RECIPE + [
    "model.path=tiny:flux_kontext",
    "model.condition_area=4096",
    "data.train=data/shapes_edit.jsonl",
    "rollout.num_inference_steps=3",
    "rollout.height=64",
    "rollout.width=64",
]


def test_flow_grpo_on_tiny_flux_kontext_trains_the_lora(workdir):
    result = train(config="flux_kontext_flow_grpo", overrides=TINY_KONTEXT)
    assert result["last_step"] == 1
    trained_lora("runs/flux-kontext-flow-grpo", 1)
    rows = lance.dataset("runs/flux-kontext-flow-grpo/trajectories.lance").to_table(columns=["metadata"])
    images = {json.loads(m)["image"] for m in rows.column("metadata").to_pylist()}
    assert len(images) == 2 and all(p.endswith(".png") and "data/shapes_edit/" in p for p in images)
