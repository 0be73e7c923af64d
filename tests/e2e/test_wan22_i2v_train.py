"""`diffrl train` of the shipped Wan2.2 I2V recipe on the tiny two-expert "wan_i2v" on the CPU, with FlowGRPO (the
recipe's step-1 window: the high-noise expert alone learns) and DanceGRPO (a window across the expert boundary: both
learn). Prompt rows carry a first frame, one a last frame too; the frames travel by reference and the stored
condition is diffusers' own for each row's frames."""

from __future__ import annotations

import json
import math

import lance
import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline
from mlflow.tracking import MlflowClient
from PIL import Image
from safetensors.torch import load as load_tensors
from safetensors.torch import load_file

from diffrl.engines.train.checkpoint import lora_file_name
from diffrl.flows.build import resolve_model_path
from diffrl.flows.train import train

RUN = "runs/wan22-i2v-flow-grpo"
ROWS = {  # prompt -> (first frame, last frame or None): one image-to-video row, one first/last-frame row
    "a red ball rolls to the left": ("a.png", None),
    "the sun sets over the sea": ("b.png", "c.png"),
}
# 2 prompts x 2 videos, 4 denoising steps at 16x16x5; at shift 5 the timesteps are 1000, 938 (the high-noise expert,
# >= boundary 0.9 x 1000) and 833, 625 (the low-noise one); no CFG; rewards that need no weights.
TINY_I2V = [
    "model.path=tiny:wan_i2v",
    "model.dtype=fp32",
    "model.device=cpu",
    "data.train=prompts.jsonl",
    "data.val=null",
    "data.num_val_prompts=0",
    "reward.components=[{name: jpeg_compressibility}, {name: temporal_consistency, weight: 0.2}]",
    "run.checkpoint_every=1",
    "run.validate_every=0",
    "run.log_images=0",
    "rollout.num_inference_steps=4",
    "rollout.height=16",
    "rollout.width=16",
    "rollout.num_frames=5",
    "rollout.max_sequence_length=24",
    "rollout.guidance_scale=1.0",
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
ACROSS_EXPERTS = "window: {kind: random_start, size: 2, start_range: [1, 2]}"  # steps 1 (high) and 2 (low)


def _prompt_file() -> None:
    """prompts.jsonl with ROWS; the frames are 24x24 (the pipeline resizes them to 16x16), paths relative to it."""
    rng = np.random.default_rng(0)
    for name in ("a", "b", "c"):
        Image.fromarray(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(f"{name}.png")
    with open("prompts.jsonl", "w") as f:
        for prompt, (image, last) in ROWS.items():
            f.write(json.dumps({"prompt": prompt, "image": image, **({"last_image": last} if last else {})}) + "\n")


@pytest.mark.parametrize(
    ("algorithm", "steps", "learns"),
    [
        ("flow_grpo", 2, {"transformer": True, "transformer_2": False}),
        (f"{{name: dance_grpo, {ACROSS_EXPERTS}}}", 1, {"transformer": True, "transformer_2": True}),
    ],
    ids=["flow_grpo", "dance_grpo"],
)
def test_i2v_recipe_trains_the_experts_its_window_reaches(workdir, algorithm, steps, learns):
    _prompt_file()
    overrides = TINY_I2V + [f"run.steps={steps}"] + ([] if algorithm == "flow_grpo" else [f"algorithm={algorithm}"])
    result = train(config="wan22_i2v_flow_grpo", overrides=overrides)
    assert result["last_step"] == steps
    step_dir = f"{RUN}/checkpoints/step_{steps}"
    with open(f"{step_dir}/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
    for component, moved in learns.items():  # LoRA B starts at zero: it moves only where a trained step denoised
        lora = load_file(f"{step_dir}/lora/{lora_file_name(component)}")
        assert lora and any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items()) == moved
    mlflow = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    for key in ("critic/rewards/mean", "reward/temporal_consistency", "actor/grad_norm"):
        history = mlflow.get_metric_history(result["mlflow_run_id"], key)
        assert sorted(m.step for m in history) == list(range(1, steps + 1)) and all(
            math.isfinite(m.value) for m in history
        ), key
    rows = lance.dataset(f"{RUN}/trajectories.lance").to_table(columns=["prompt", "metadata"]).to_pylist()
    assert len(rows) == steps * 4
    for row in rows:  # each video's frames by reference, absolute paths to the row's files
        meta = json.loads(row["metadata"])
        first, last = ROWS[row["prompt"]]
        assert meta["image"] == str(workdir / first) and meta.get("last_image") == (last and str(workdir / last))
    if algorithm == "flow_grpo":
        _check_stored_conditions(workdir)


def _check_stored_conditions(workdir) -> None:
    """The prompt-embedding table holds, for each row, the condition diffusers' WanImageToVideoPipeline makes from
    that row's first (and last) frame at the sample size: the frame mask and the VAE latents."""
    pipe = WanImageToVideoPipeline.from_pretrained(resolve_model_path("tiny:wan_i2v"))
    stored = lance.dataset(f"{RUN}/embeddings.lance").to_table(columns=["prompt", "encoding"]).to_pylist()
    assert len(stored) == len(ROWS)  # one encoding per prompt and frames, made once over both steps
    for row in stored:
        first, last = ROWS[row["prompt"].split("\x00")[0]]  # the prompt, then the frames' content digests

        def frame(name):
            return pipe.video_processor.preprocess(Image.open(workdir / name).convert("RGB"), height=16, width=16)

        _, expected = pipe.prepare_latents(
            frame(first), 1, 4, 16, 16, 5, torch.float32, "cpu", last_image=None if last is None else frame(last)
        )
        condition = load_tensors(row["encoding"])["condition"]
        # mask channels: latent frame 0 marks the first frame (all 4), latent frame 1's last channel the last frame
        assert condition[0, :4, :, 0, 0].tolist() == [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, float(bool(last))]]
        torch.testing.assert_close(condition, expected, rtol=0, atol=1e-5)
