"""`diffrl train` of the shipped HunyuanVideo-1.5 recipe on the tiny "hunyuan_video15" on the CPU, with FlowGRPO (the
recipe) and DanceGRPO: the LoRA learns, and the OCR prompts' quoted texts reach the glyph encoder through the
prompt-embedding cache."""

from __future__ import annotations

import json
import math

import lance
import pytest
from safetensors.torch import load as load_tensors
from safetensors.torch import load_file

from diffrl.engines.train.checkpoint import lora_file_name
from diffrl.flows.train import train

RUN = "runs/hunyuan-video15-flow-grpo"
# 2 OCR prompts x 2 videos, 4 denoising steps at 16x16x5 (one latent token per frame), CFG 6 with the recipe's
# window (60% of the steps); rewards that need no weights.
TINY_HV15 = [
    "model.path=tiny:hunyuan_video15",
    "model.dtype=fp32",
    "model.device=cpu",
    "reward.components=[{name: jpeg_compressibility}]",
    "data.val=null",
    "data.num_generated=8",
    "data.num_val_prompts=0",
    "run.steps=1",
    "run.checkpoint_every=1",
    "run.validate_every=0",
    "run.log_images=0",
    "rollout.num_inference_steps=4",
    "rollout.height=16",
    "rollout.width=16",
    "rollout.num_frames=5",
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


@pytest.mark.parametrize("algorithm", ["flow_grpo", "dance_grpo"])
def test_recipe_trains_the_lora(workdir, algorithm):
    overrides = TINY_HV15 + ([] if algorithm == "flow_grpo" else ["algorithm=dance_grpo"])
    result = train(config="hunyuan_video15_flow_grpo", overrides=overrides)
    assert result["last_step"] == 1
    step_dir = f"{RUN}/checkpoints/step_1"
    with open(f"{step_dir}/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
    lora = load_file(f"{step_dir}/lora/{lora_file_name('transformer')}")  # LoRA B starts at zero
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())
    stored = lance.dataset(f"{RUN}/embeddings.lance").to_table(columns=["prompt", "encoding"]).to_pylist()
    glyph_tokens = {row["prompt"]: int(load_tensors(row["encoding"])["prompt_embeds_mask_2"].sum()) for row in stored}
    assert len(glyph_tokens) == 3 and glyph_tokens.pop("") == 0  # the negative prompt quotes nothing
    for prompt, tokens in glyph_tokens.items():  # every OCR prompt quotes its text: the glyph encoder read it
        assert '"' in prompt and tokens > 0, prompt
