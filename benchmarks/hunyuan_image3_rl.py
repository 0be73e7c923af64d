"""FlowGRPO on HunyuanImage-3.0 through the step core, engines only: images/GPU/s of the RL step and peak GPU memory.

The engines-only loop of benchmarks/bagel_rl.py: `build_engines(cfg, durable=False)` and the step core's stages
called directly (generate -> score -> advantages -> update_actor -> sync_weights), no trajectory store, no MLflow.
The model is a configs-only folder of the released config (diffrl/models/hunyuan_image3/realsize.py) built with
random weights in memory on the device (`model.path: random:<folder>`). The whole model (81 B parameters, ~162 GB in
bf16) does not fit one H200, so the GPU default cuts the decoder to `--layers 4` (4 of 32 identical MoE layers:
10.87 B parameters built, meta-device count, ~22 GB): per-layer costs scale to the full model by 32 / layers (the
image head, embeddings and VAE are outside the layers). The recipe is diffrl/configs/hunyuan_image3_flow_grpo.yaml
at 1024x1024 (the model's 1:1 bucket), 10 steps, with the jpeg_compressibility reward (a CPU rule: the GPU figures
are the model's).

    python -m benchmarks.hunyuan_image3_rl                         # GPU: 4 layers, bf16, 2 prompts x 4, 3 steps
    python -m benchmarks.hunyuan_image3_rl --layers 8 --tag l8     # a larger cut
    python -m benchmarks.hunyuan_image3_rl --set "algorithm={name: mix_grpo}"   # another algorithm
    python -m benchmarks.hunyuan_image3_rl --smoke                 # CPU: tiny configs, 2 steps (numbers meaningless)

Per step: timing_s/generate and /update_actor, perf/throughput (images/GPU/s), the rollout / replay log-prob gap,
peak memory. The first step is warm-up and left out of the means. Writes
benchmarks/results/hunyuan_image3_rl_<device>[_<tag>].json after every step. Not yet run on a GPU (written on a
CPU-only day).
"""

from __future__ import annotations

import argparse
import os
import tempfile

from benchmarks.bagel_rl import train_steps
from diffrl.configs.schema import load_experiment
from diffrl.models.hunyuan_image3.realsize import write_config_folder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recipe(folder: str, args: argparse.Namespace) -> list[str]:
    """hunyuan_image3_flow_grpo.yaml at the benchmark's size (overrides)."""
    gpu = args.device != "cpu"
    samples = args.prompts * args.group
    return [
        f"model.path=random:{folder}",
        f"model.device={args.device}",
        f"model.dtype={'bf16' if gpu else 'fp32'}",
        f"run.name=hunyuan-image3-rl-{args.tag or 'bench'}",
        f"run.steps={args.steps}",
        "run.validate_every=0",
        f"rollout.num_inference_steps={args.num_inference_steps}",
        f"rollout.height={args.resolution}",
        f"rollout.width={args.resolution}",
        f"rollout.group_size={args.group}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.chunk_size={samples}",
        f"rollout.batch_size={args.rollout_batch}",
        f"train.mini_batch_prompts={args.prompts}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.gradient_checkpointing={'true' if args.checkpointing else 'false'}",
        "reward.components=[{name: jpeg_compressibility}]",
        "data.num_val_prompts=0",
        "data.num_generated=256",
        *args.set,
    ]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny configs, 2 steps of 2 x 2 at 64x64")
    parser.add_argument("--device", default=None, help="cuda (default) or cpu (--smoke)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (the release has 32; default 4)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an extra config override (repeatable)"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step (x --group images)")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--num-inference-steps", type=int, default=10)
    parser.add_argument("--rollout-batch", type=int, default=4, help="images per rollout forward (x2 rows with CFG)")
    parser.add_argument("--micro-batch", type=int, default=1, help="images per forward/backward of the update")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/hunyuan_image3_rl_*.json)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device = args.device or "cpu"
        args.steps, args.prompts, args.group, args.resolution = 2, 2, 2, 64
        args.num_inference_steps, args.rollout_batch, args.micro_batch, args.layers = 3, 4, 2, None
    args.device = args.device or "cuda"
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    tag = f"_{args.tag}" if args.tag else ""
    out = args.out or os.path.join(
        REPO, "benchmarks", "results", f"hunyuan_image3_rl_{args.device.split(':')[0]}{tag}.json"
    )
    with tempfile.TemporaryDirectory() as tmp:
        size = "tiny" if args.smoke else "80b"
        folder = write_config_folder(os.path.join(tmp, "hunyuan_image3"), size=size, layers=args.layers)
        cfg = load_experiment("hunyuan_image3_flow_grpo", recipe(folder, args) + [f"run.root={tmp}/runs"])
        return train_steps(cfg, args, out)


if __name__ == "__main__":
    main()
