"""Run by test_fsdp.py under torchrun (gloo, 2 processes): a LoRA trainer sharded with FSDP2 (and one replicated, as
engine replicas train) saves a checkpoint after one update; a fresh trainer loads it and must hold the same weights
and optimizer state on every rank, and train on from them. Rank 0 writes what it compared (JSON).

    python -m torch.distributed.run --standalone --nproc_per_node 2 fsdp_resume_worker.py MODEL OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from diffrl.algorithms.catalog import get_algorithm  # noqa: E402
from diffrl.configs.rollout import SamplingConfig  # noqa: E402
from diffrl.configs.train import TrainConfig  # noqa: E402
from diffrl.engines.rollout.engine import RolloutEngine  # noqa: E402
from diffrl.engines.train.trainer import PolicyTrainer  # noqa: E402
from diffrl.models.base import load_adapter  # noqa: E402

SAMPLING = SamplingConfig(num_inference_steps=3, height=32, width=32, noise_level=0.7, batch_size=4)


def build(model_path: str, replicate: bool) -> tuple[RolloutEngine, PolicyTrainer]:
    torch.manual_seed(0)
    adapter = load_adapter(model_path, device="cpu")
    cfg = TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2, mini_batch_prompts=1, micro_batch_size=1, seed=3)
    algorithm = get_algorithm("flow_grpo", kl_coef=0.0, clip_ratio=0.2)
    trainer = PolicyTrainer(adapter, algorithm, cfg, SAMPLING, group_size=2, replicate=replicate)
    return RolloutEngine(adapter, progress=False), trainer


def full(value):
    """The whole tensor of a (possibly sharded) parameter or optimizer state."""
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()


def state(trainer: PolicyTrainer) -> tuple[dict, dict]:
    """(trainable weights, optimizer state) by parameter name, whole tensors."""
    names = {id(p): n for n, p in trainer.adapter.transformer.named_parameters()}
    weights = {names[id(p)]: full(p) for p in trainer.params}
    optim = {names[id(p)]: {k: full(v) for k, v in s.items()} for p, s in trainer.optimizer.state.items()}
    return weights, optim


def largest_gap(a: dict, b: dict) -> float:
    gaps = [float((x.float() - b[k].float()).abs().max()) for k, x in a.items() if torch.is_tensor(x)]
    gaps += [largest_gap(x, b[k]) for k, x in a.items() if isinstance(x, dict)]
    return max(gaps, default=0.0)


def main(model_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    report = {}
    for replicate in (False, True):
        engine, trainer = build(model_path, replicate)
        prompts, groups = ["a red cube", "a red cube", "two cats", "two cats"], ["g0", "g0", "g1", "g1"]
        traj = engine.generate(prompts, groups, [0, 1, 0, 1], [11, 12, 13, 14], SAMPLING)
        advantages = torch.tensor([1.0, -1.0, 0.7, -0.7])
        trainer.update(traj, advantages, engine)
        path = os.path.join(out_dir, f"ckpt-{replicate}")
        trainer.save_checkpoint(path, step=1)
        _, resumed = build(model_path, replicate)
        resumed.load_checkpoint(path)
        (w1, o1), (w2, o2) = state(trainer), state(resumed)
        gaps = torch.tensor([largest_gap(w1, w2), largest_gap(o1, o2)])
        dist.all_reduce(gaps, op=dist.ReduceOp.MAX)  # the worst rank
        norms = [trainer.update(traj, advantages, engine)["actor/grad_norm"] for trainer in (trainer, resumed)]
        finite = all(bool(torch.isfinite(full(p)).all()) for p in resumed.params)
        report["replicated" if replicate else "sharded"] = dict(
            weights_gap=float(gaps[0]), optimizer_gap=float(gaps[1]), grad_norms=norms, finite=finite
        )
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "resume.json"), "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
