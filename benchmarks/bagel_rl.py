"""FlowGRPO on BAGEL-7B-MoT through the step core, engines only: images/GPU/s of the RL step and peak GPU memory.

The engines-only loop of benchmarks/omni_rl.py: `build_engines(cfg, durable=False)` and the step core's `run_step`
with the stages called directly (generate -> score -> advantages -> update_actor -> sync_weights: the stage functions
`diffrl train` runs as Prefect tasks), no trajectory store, no MLflow. The model is a configs-only folder at the real
size (diffrl/models/bagel/realsize.py: Qwen2.5-7B-shaped MoT with both experts, 13.6 B parameters, FLUX VAE) built
with random weights in memory on the device (`model.path: random:<folder>`), so no 29 GB checkpoint is needed. The
recipe is diffrl/configs/bagel_flow_grpo.yaml (VeRL-Omni's BAGEL OCR LoRA settings) at 512x512, 10 steps, group 16,
with the jpeg_compressibility reward (a CPU rule: the GPU figures are the model's, not an OCR model's).

    python -m benchmarks.bagel_rl                       # GPU: BAGEL-7B-MoT, bf16, 4 prompts x 16, 3 steps
    python -m benchmarks.bagel_rl --prompts 2 --layers 14 --tag half   # a smaller cut
    python -m benchmarks.bagel_rl --smoke               # CPU: the tiny BAGEL configs, 2 steps (numbers meaningless)

Per step: timing_s/generate and /update_actor, perf/throughput (images/GPU/s: images / step seconds), the rollout /
replay log-prob gap, peak memory. The first step is warm-up and left out of the means. Writes
benchmarks/results/bagel_rl_<device>[_<tag>].json after every step. Not yet run on a GPU (written on a CPU-only day).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from benchmarks.common import record_steps
from diffrl.configs.schema import load_experiment
from diffrl.flows.build import build_engines
from diffrl.models.bagel.realsize import write_config_folder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEPT = (
    "timing_s/generate",
    "timing_s/update_actor",
    "timing_s/sync_weights",
    "actor/grad_norm",
    "actor/pg_clipfrac",
    "rollout_corr/logprob_abs_diff_max",
    "perf/time_per_step",
    "perf/throughput",
)


def recipe(folder: str, args: argparse.Namespace) -> list[str]:
    """bagel_flow_grpo.yaml at the benchmark's size (overrides)."""
    gpu = args.device != "cpu"
    samples = args.prompts * args.group
    return [
        f"model.path=random:{folder}",
        f"model.device={args.device}",
        f"model.dtype={'bf16' if gpu else 'fp32'}",
        f"run.name=bagel-rl-{args.tag or 'bench'}",
        f"run.steps={args.steps}",
        "run.validate_every=0",
        f"rollout.num_inference_steps={args.num_inference_steps}",
        f"rollout.height={args.resolution}",
        f"rollout.width={args.resolution}",
        f"rollout.group_size={args.group}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.chunk_size={samples}",
        f"rollout.batch_size={args.rollout_batch}",
        f"algorithm.window.start_range=[0, {min(7, args.num_inference_steps - 2)}]",
        f"train.mini_batch_prompts={args.prompts}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.gradient_checkpointing={'true' if args.checkpointing else 'false'}",
        "reward.components=[{name: jpeg_compressibility}]",
        "data.num_val_prompts=0",
        "data.num_generated=256",
    ]


def summary(steps: list[dict]) -> dict:
    """Means over the steps after the first (warm-up; all of them when there is one)."""
    measured = steps[1:] or steps
    mean = {key: statistics.fmean(s[key] for s in measured) for key in measured[0]}
    return {
        "images_per_gpu_s": mean["perf/throughput"],
        "step_s": mean["perf/time_per_step"],
        "steps_measured": len(measured),
        "mean": mean,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny BAGEL configs, 2 steps of 2 x 2 at 32x32")
    parser.add_argument("--device", default=None, help="cuda (default) or cpu (--smoke)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: BAGEL-7B-MoT's 28)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (x --group images)")
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--num-inference-steps", type=int, default=10)
    parser.add_argument("--rollout-batch", type=int, default=16, help="images per rollout forward (x2 rows with CFG)")
    parser.add_argument("--micro-batch", type=int, default=4, help="images per forward/backward of the update")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/bagel_rl_<device>.json)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device = args.device or "cpu"
        args.steps, args.prompts, args.group, args.resolution = 2, 2, 2, 32
        args.num_inference_steps, args.rollout_batch, args.micro_batch = 3, 4, 2
    args.device = args.device or "cuda"
    out = args.out or os.path.join(
        REPO, "benchmarks", "results", f"bagel_rl_{args.device.split(':')[0]}{'_' + args.tag if args.tag else ''}.json"
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_config_folder(
            os.path.join(tmp, "bagel"), size="tiny" if args.smoke else "7b-mot", layers=args.layers
        )
        cfg = load_experiment("bagel_flow_grpo", recipe(folder, args) + [f"run.root={tmp}/runs"])
        return train_steps(cfg, args, out)


def train_steps(cfg, args, out: str | None) -> dict:
    """Build `cfg`'s engines (durable=False) and run its steps through the step core, recording the model's size,
    the build seconds and each step's KEPT metrics into `out` as they come (also benchmarks/hunyuan_image3_rl.py)."""
    started = time.perf_counter()
    engines = build_engines(cfg, durable=False)
    result = {
        "recipe": vars(args),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "parameters": sum(p.numel() for p in engines.adapter.transformer.parameters()),
        "trainable_parameters": sum(p.numel() for p in engines.trainer.params),
        "build_s": time.perf_counter() - started,
        "torch": torch.__version__,
        "steps": [],
    }
    try:
        record_steps(engines, cfg, result, out, lambda m: {k: float(m[k]) for k in KEPT if k in m}, summary)
    finally:
        engines.memory.close()
    return result


if __name__ == "__main__":
    main()
