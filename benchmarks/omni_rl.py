"""GSPO on a Qwen3-Omni Thinker through the step core, engines only: generated tokens/s of the rollout and of the
update, samples/GPU/s of the RL step, peak GPU memory.

The engines-only loop of benchmarks/shapes_rl.py: `build_engines(cfg, durable=False)` and the step core's `run_step`
with the stages called directly (generate -> score -> advantages -> update_actor -> sync_weights: the stage functions
`diffrl train` runs as Prefect tasks), no trajectory store, no MLflow. The policy is built from a config-only folder
(diffrl/models/causal_lm/realsize.py: `model.path: random:<folder>`), random weights made in memory on the device, so
the real-size 30B-A3B Thinker needs no weights on disk. Random weights never emit the end token: every response is
`--max-new-tokens` long, the length the figures are quoted at. The in-process transformers rollout (`generate`) is
what is measured; the vLLM engine has its own benchmark (benchmarks/vllm_ar.py).

    python -m benchmarks.omni_rl                      # GPU: 30B-A3B Thinker, bf16, LoRA r32 on attention, GSPO,
                                                      # group 8, 1024-token responses
    python -m benchmarks.omni_rl --layers 24 --prompts 4 --max-new-tokens 512     # a smaller cut
    python -m benchmarks.omni_rl --smoke              # CPU: the tiny Thinker config, 2 steps (numbers meaningless)

Per step: timing_s/generate and /update_actor, response tokens (samples x mean length), rollout tokens/s = response
tokens / generate seconds, update tokens/s = response tokens / update seconds (one forward + backward of every
response, the old-log-prob forward not needed: same numerics in one process), samples/GPU/s (perf/throughput:
samples / step seconds), the rollout/trainer log-prob gap. The first step is warm-up and left out of the means.
Writes benchmarks/results/omni_rl_<device>[_<tag>].json after every step (a run stopped early keeps what it
measured).
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
from diffrl.models.causal_lm.realsize import write_config_folder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEPT = (
    "timing_s/generate",
    "timing_s/update_actor",
    "timing_s/sync_weights",
    "response_length/mean",
    "actor/entropy",
    "actor/grad_norm",
    "actor/pg_clipfrac",
    "rollout_corr/logprob_abs_diff_max",
    "perf/time_per_step",
    "perf/throughput",
)


def recipe(folder: str, args: argparse.Namespace) -> list[str]:
    """omni_quick's config turned into the GSPO recipe at the benchmark's size (overrides)."""
    gpu = args.device != "cpu"  # bf16 weights on the GPU (the LoRA stays fp32), fp32 on the CPU
    samples = args.prompts * args.group
    return [
        f"model.path=random:{folder}",
        f"model.device={args.device}",
        f"model.dtype={'bf16' if gpu else 'fp32'}",
        "algorithm=gspo",
        f"run.name=omni-rl-{args.tag or 'bench'}",
        f"run.steps={args.steps}",
        f"rollout.group_size={args.group}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.chunk_size={samples}",
        f"rollout.batch_size={samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "train.lora=true",  # LoRA r32 on the language model's attention (the smoke run too: the same code path)
        "train.lora_rank=32",
        "train.lora_alpha=64",
        "train.gradient_checkpointing=true",
        f"train.mini_batch_prompts={args.prompts}",
        f"train.micro_batch_size={args.micro_batch}",
        "data.num_val_prompts=0",
        "data.num_generated=256",
    ]


def summary(steps: list[dict], warmup: int = 1) -> dict:
    """Means over the steps after the first `warmup` (all of them when there are no more)."""
    measured = steps[warmup:] or steps
    mean = {key: statistics.fmean(s[key] for s in measured) for key in measured[0]}
    return {
        "rollout_tokens_per_s": mean["response_tokens"] / mean["timing_s/generate"],
        "update_tokens_per_s": mean["response_tokens"] / mean["timing_s/update_actor"],
        "samples_per_gpu_s": mean["perf/throughput"],
        "step_s": mean["perf/time_per_step"],
        "steps_measured": len(measured),
        "mean": mean,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny Thinker config, 2 steps of 2 x 2 samples")
    parser.add_argument("--device", default=None, help="cuda (default) or cpu (--smoke)")
    parser.add_argument("--layers", type=int, default=48, help="text decoder layers of the 30B-A3B Thinker")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (x --group samples)")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward of the update")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/omni_rl_<device>.json)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device = args.device or "cpu"
        args.steps, args.prompts, args.group, args.max_new_tokens, args.micro_batch = 2, 2, 2, 8, 4
    args.device = args.device or "cuda"
    out = args.out or os.path.join(
        REPO, "benchmarks", "results", f"omni_rl_{args.device.split(':')[0]}{'_' + args.tag if args.tag else ''}.json"
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_config_folder(
            os.path.join(tmp, "thinker"), size="tiny" if args.smoke else "30b-a3b", layers=args.layers
        )
        cfg = load_experiment("omni_quick", recipe(folder, args) + [f"run.root={tmp}/runs"])
        started = time.perf_counter()
        engines = build_engines(cfg, durable=False)
        result = {
            "recipe": vars(args),
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "parameters": sum(p.numel() for p in engines.adapter.model.parameters()),
            "trainable_parameters": sum(p.numel() for p in engines.trainer.params),
            "build_s": time.perf_counter() - started,
            "torch": torch.__version__,
            "steps": [],
        }
        try:
            record_steps(engines, cfg, result, out, keep_token_metrics, summary)
        finally:
            engines.memory.close()
    return result


def keep_token_metrics(metrics: dict) -> dict:
    """A token run's per-step record: the KEPT metrics, what a rollout server measured (vllm/*, rollout/tokens_per_s,
    timing_s/wake, /sleep, /offload) and the response tokens it generated."""
    served = ("vllm/", "rollout/tokens_per_s", "rollout/generated_tokens", "timing_s/wake", "timing_s/sleep")
    kept = {k: float(metrics[k]) for k in KEPT if k in metrics}
    kept.update({k: float(v) for k, v in metrics.items() if k.startswith(served) or k == "timing_s/offload"})
    kept["response_tokens"] = metrics["response_length/mean"] * metrics["rollout/samples"]
    return kept


if __name__ == "__main__":
    main()
