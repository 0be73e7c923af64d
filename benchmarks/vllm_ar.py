"""GSPO with the vLLM rollout engine, engines only: the engines `diffrl train thinker_text_gspo_vllm` builds, driven
through the step core without Prefect, Lance or MLflow. A vLLM server samples, diffrl's trainer updates a LoRA, the
adapter of each new policy version is loaded into the server, the next step samples it.

    python -m benchmarks.vllm_ar --out benchmarks/results/vllm_ar_engines_h200.json   # one GPU, see below
    python -m benchmarks.vllm_ar --smoke --out /tmp/vllm_ar_cpu.json                  # CPU: tiny Qwen3, 2 steps

The config is diffrl/configs/thinker_text_gspo_vllm.yaml at the benchmark's size (the overrides of `recipe`, then
`--set`), its engines built by `build_engines(cfg, durable=False)` and its steps run by the step core's `run_step`
with the stages called directly (generate -> score -> advantages -> update_actor -> sync_weights, as
benchmarks/omni_rl.py drives the in-process rollout). GPU: the Qwen3-Omni-30B-A3B Thinker's text backbone
(diffrl/models/causal_lm/realsize.py size 30b-a3b-text, `--layers` of its 48) from its config alone: the server loads
it with `load_format: dummy`, the trainer builds the same architecture with random bf16 weights on the GPU
(`model.path: random:<folder>`), LoRA r`--lora-rank` on attention, gradient checkpointing; the server takes
`--gpu-memory-utilization` of the GPU and, with `--sleep` (default on a GPU), sleeps through each update, while with
`--offload` (default on a GPU) the trainer's state waits in host memory during each rollout. On the GPU
machine (no network) the server's interpreter is `DIFFRL_VLLM_PYTHON=python3` with the offline vLLM bundle in
`DIFFRL_VLLM_PYTHONPATH` (docs/operations.md, "Machines without network"). The reward is the recipe's
`length_target`, which varies on random text (so the advantages are not all 0).

Per step (the KEPT metrics of benchmarks/omni_rl.py, and the server's vllm/* and rollout/tokens_per_s,
timing_s/wake, /sleep and /offload): timing_s/generate, /update_actor and /sync_weights, response tokens,
samples/GPU/s (perf/throughput), the rollout/trainer log-prob gap, the trainer's peak memory; means over the
steps after `--warmup`, the result rewritten after every step. At real size the gap is NOT a numerics figure: the
server's dummy weights are not the trainer's random ones; the CPU smoke run (both sides load tiny:qwen3 in fp32) and
tests/vllm/test_train_vllm.py measure it with shared weights.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

import torch

from benchmarks.common import record_steps
from benchmarks.omni_rl import keep_token_metrics, summary
from diffrl.configs.schema import load_experiment
from diffrl.flows.build import build_engines
from diffrl.models.causal_lm.realsize import write_config_folder

CONFIG = "thinker_text_gspo_vllm"
# CPU: vLLM's CPU build in fp32 on the tiny model both sides load (tests/vllm/test_train_vllm.py's settings)
SMOKE = (
    "model.path=tiny:qwen3",
    "model.device=cpu",
    "model.dtype=fp32",
    "rollout.vllm.dtype=float32",
    "rollout.vllm.load_format=auto",
    "rollout.vllm.enforce_eager=true",
    "rollout.vllm.max_model_len=1024",
    # >= 8 x 1024: prefills are never split (vLLM 0.24 on a CPU fails a seeded request whose prefill is split)
    "rollout.vllm.max_num_batched_tokens=8192",
    "rollout.vllm.start_timeout_s=300",
    "rollout.vllm.request_timeout_s=60",
    "train.gradient_checkpointing=false",
    "train.micro_batch_size=2",
)


def recipe(args: argparse.Namespace, model_path: str) -> list[str]:
    """thinker_text_gspo_vllm.yaml at the benchmark's size (overrides)."""
    samples = args.prompts * args.group_size
    sized = [
        f"model.path={model_path}",
        f"run.steps={args.steps}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}",
        f"rollout.chunk_size={samples}",
        f"rollout.batch_size={samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.vllm.max_num_seqs={samples}",
        f"rollout.vllm.concurrency={args.prompts}",
        f"rollout.vllm.max_lora_rank={args.lora_rank}",
        f"rollout.vllm.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"rollout.vllm.sleep_for_update={str(args.sleep).lower()}",
        f"rollout.vllm.offload_trainer={str(args.offload).lower()}",
        f"train.lora_rank={args.lora_rank}",
        f"train.lora_alpha={2 * args.lora_rank}",
        f"train.mini_batch_prompts={args.prompts}",
        "data.num_val_prompts=0",
    ]
    return [*(SMOKE if args.smoke else ()), *sized, *args.set]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny Qwen3, fp32, short responses")
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default 5; --smoke 2)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the means")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 1024; --smoke 16")
    parser.add_argument("--layers", type=int, default=48, help="text layers of the real-size backbone")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.65)
    parser.add_argument("--sleep", action=argparse.BooleanOptionalAction, default=None, help="default: on a GPU")
    parser.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None, help="default: on a GPU")
    parser.add_argument("--set", nargs="*", default=[], help="more dotted overrides of the config")
    parser.add_argument("--out", default=None, help="the result JSON, rewritten after every step")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.smoke else 5)
    args.max_new_tokens = args.max_new_tokens or (16 if args.smoke else 1024)
    args.sleep = (not args.smoke) if args.sleep is None else args.sleep
    args.offload = (not args.smoke) if args.offload is None else args.offload
    if args.smoke:
        args.prompts, args.group_size = min(args.prompts, 2), min(args.group_size, 4)
    with tempfile.TemporaryDirectory(prefix="vllm_ar_") as tmp:
        if args.smoke:
            model_path = "tiny:qwen3"
        else:  # config.json and an offline tokenizer: the server's dummy weights, the trainer's random ones
            folder = write_config_folder(os.path.join(tmp, "model"), size="30b-a3b-text", layers=args.layers)
            model_path = f"random:{folder}"
        cfg = load_experiment(CONFIG, [*recipe(args, model_path), f"run.root={tmp}/runs"])
        started = time.perf_counter()
        engines = build_engines(cfg, durable=False)  # starts the vLLM server
        result = {
            "command": " ".join(["python", "-m", "benchmarks.vllm_ar", *(sys.argv[1:] if argv is None else argv)]),
            "config": CONFIG,
            "overrides": recipe(args, model_path),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
            "args": vars(args),
            "build_s": time.perf_counter() - started,
            "torch": torch.__version__,
            "logprob_gap_note": None if args.smoke else "dummy server weights vs random trainer weights: not numerics",
            "steps": [],
        }
        try:
            record_steps(
                engines, cfg, result, args.out, keep_token_metrics, functools.partial(summary, warmup=args.warmup)
            )
        finally:
            engines.memory.close()  # stops the vLLM server
    return result


if __name__ == "__main__":
    main()
