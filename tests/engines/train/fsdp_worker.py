"""Run by test_fsdp.py, under torchrun (gloo, 2 processes) or plainly (1 process); also by
benchmarks/fsdp_equivalence.py on GPUs (NCCL, bf16):

    python fsdp_worker.py MODEL OUT_DIR [cpu|cuda] [fp32|bf16|fp32,bf16] [MICRO_BATCH_SIZE]

MICRO_BATCH_SIZE (default 1) changes only the order of the gradient sums (the benchmark's noise floor). Several
dtypes (comma-separated) run one after the other in the same processes and process group (one start-up of the
interpreters and of torchrun for all), each writing into OUT_DIR/<dtype>.

Generates the same trajectories in every process (before sharding), trains two RL steps with FSDP2 when
the world size is > 1, and has rank 0 write the updated trainable weights (safetensors) and the metrics (JSON).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from diffrl.algorithms.catalog import get_algorithm  # noqa: E402
from diffrl.configs.rollout import SamplingConfig  # noqa: E402
from diffrl.configs.train import TrainConfig  # noqa: E402
from diffrl.engines.rollout.engine import RolloutEngine  # noqa: E402
from diffrl.engines.train.checkpoint import trainable_state  # noqa: E402
from diffrl.engines.train.trainer import PolicyTrainer  # noqa: E402
from diffrl.models.base import load_adapter  # noqa: E402


def main(model_path: str, out_dir: str, device: str = "cpu", dtype: str = "fp32", micro_batch_size: str = "1") -> None:
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
        # fp32 means fp32: cuDNN convolutions (the patch embedding) default to TF32 on CUDA.
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    dtypes = dtype.split(",")
    for name in dtypes:
        target = os.path.join(out_dir, name) if len(dtypes) > 1 else out_dir
        os.makedirs(target, exist_ok=True)
        train_two_steps(model_path, target, device, name, int(micro_batch_size))
    if dist.is_initialized():
        dist.destroy_process_group()


def train_two_steps(model_path: str, out_dir: str, device: str, dtype: str, micro_batch_size: int) -> None:
    """Two FlowGRPO updates of a fresh adapter in `dtype` on the same seeded trajectories; rank 0 writes the
    trainable weights and the metrics into out_dir."""
    torch.manual_seed(0)
    adapter = load_adapter(model_path, device=device, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    sampling = SamplingConfig(num_inference_steps=3, height=32, width=32, noise_level=0.7, batch_size=4)
    engine = RolloutEngine(adapter, progress=False)
    traj = engine.generate(
        ["a red cube", "a red cube", "two cats", "two cats"],
        ["g0", "g0", "g1", "g1"],
        [0, 1, 0, 1],
        [11, 12, 13, 14],
        sampling,
    )
    advantages = torch.tensor([1.0, -1.0, 0.7, -0.7])
    cfg = TrainConfig(
        lora_rank=4, lora_alpha=8, lr=1e-2, mini_batch_prompts=1, micro_batch_size=micro_batch_size, seed=3
    )
    trainer = PolicyTrainer(
        adapter,
        get_algorithm("flow_grpo", kl_coef=0.04, clip_ratio=0.2),
        cfg,
        sampling,
        group_size=2,
        device=torch.device(device),
    )
    metrics = [trainer.update(traj, advantages, engine) for _ in range(2)]
    weights = trainable_state(trainer)
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_file(weights, os.path.join(out_dir, "weights.safetensors"))
        with open(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f)


if __name__ == "__main__":
    main(*sys.argv[1:6])
