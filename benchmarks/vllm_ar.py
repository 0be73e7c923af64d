"""GSPO with the vLLM rollout engine engines only: a vLLM server samples, diffrl's TokenTrainer
updates a LoRA, the adapter of each new policy version is loaded into the server, the next step samples it.

    python benchmarks/vllm_ar.py --out benchmarks/results/vllm_ar_h200.json      # one GPU, see below
    python benchmarks/vllm_ar.py --smoke --out /tmp/vllm_ar_cpu.json             # CPU: tiny Qwen3, 2 steps

GPU: the Qwen3-Omni-30B-A3B Thinker's text backbone (a Qwen3-MoE: 48 layers, hidden 2048, 32 heads / 4 KV heads of
128, 128 experts with 8 active of 768, vocab 152064; diffrl/models/causal_lm/realsize.py size 30b-a3b-text) from its
config alone. The server loads it with
`load_format=dummy` (nothing on disk but config.json and a tokenizer), the trainer builds the same architecture with
random bf16 weights on the GPU, LoRA r=32 on attention, gradient checkpointing; group 8, `--prompts` prompts a step,
`--max-new-tokens` (1024) response tokens. The two copies share the GPU: the server takes
`--gpu-memory-utilization` of it, and with `--sleep` (default on a GPU) it is put to sleep (level 1: weights to host
memory, KV cache freed) for the update and woken for the adapter load. On the GPU machine (no network) the server's
interpreter is `DIFFRL_VLLM_PYTHON=python3` with the offline vLLM bundle in `DIFFRL_VLLM_PYTHONPATH`
(docs/operations.md, "Machines without network"), diffrl's own dependencies on PYTHONPATH.

Per step: rollout seconds and generated tokens/s, update seconds, weight-sync seconds (adapter saved + loaded),
samples/GPU/s over the whole step, the rollout/trainer log-prob gap (rollout_corr/logprob_abs_diff_{mean,max}), the
trainer's peak allocated memory and the device's used memory after the rollout and after the update. Medians over
the steps after --warmup. At real size the gap is NOT a numerics figure: the server's dummy weights are not the
trainer's random ones (the 61 GB of weights cannot go through the 64 GB disk); the CPU smoke run and
tests/vllm/test_vllm_rollout.py measure it with shared weights (fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402, F401  (puts the repository root on sys.path)
import torch  # noqa: E402

from diffrl.algorithms.advantages import group_advantages  # noqa: E402
from diffrl.algorithms.catalog import get_algorithm  # noqa: E402
from diffrl.configs.train import TrainConfig  # noqa: E402
from diffrl.configs.vllm import VllmRolloutOptions  # noqa: E402
from diffrl.engines.rollout.tokens import TokenSampling  # noqa: E402
from diffrl.engines.rollout.vllm_tokens import VllmTokenEngine  # noqa: E402
from diffrl.engines.train.tokens import TokenTrainer  # noqa: E402
from diffrl.engines.vllm_env import vllm_python  # noqa: E402
from diffrl.models.causal_lm.policy import CausalLMPolicy  # noqa: E402
from diffrl.models.causal_lm.realsize import write_config_folder  # noqa: E402

PROMPTS = [
    "how many red circles are there?",
    "what is left of the square?",
    "name the colour of the triangle.",
    "count the blue shapes.",
    "is the circle above the square?",
    "which shape is largest?",
    "what is right of the circle?",
    "how many shapes are green?",
]


def realsize_folder(out: str, layers: int) -> str:
    """config.json (+ a tokenizer built offline; ids stay far below the vocabulary) for load_format=dummy."""
    return write_config_folder(out, size="30b-a3b-text", layers=layers)


def realsize_policy(folder: str, device: str) -> CausalLMPolicy:
    """The trainer's copy: the same architecture, random bf16 weights built on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return CausalLMPolicy(model, AutoTokenizer.from_pretrained(folder), source=folder)


def synthetic_rewards(traj) -> torch.Tensor:
    """A reward with spread inside each group: the share of distinct tokens in the response."""
    return torch.tensor([len(set(r.tolist())) / max(1, len(r)) for r in traj.response_ids], dtype=torch.float32)


def device_used_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def one_step(engine, trainer, sampling, args, step: int) -> dict:
    """Rollout, update, weight sync; the step's figures."""
    rows = [(p, f"p{i}", k) for i, p in enumerate(PROMPTS[: args.prompts]) for k in range(args.group_size)]
    started = time.perf_counter()
    traj = engine.generate(
        [r[0] for r in rows],
        [r[1] for r in rows],
        [r[2] for r in rows],
        [1000 * step + i for i in range(len(rows))],
        sampling,
        policy_version=trainer.policy_version,
    )
    rollout_s = time.perf_counter() - started
    used_rollout = device_used_gib()
    advantages = group_advantages(synthetic_rewards(traj), traj.group_ids)
    if args.sleep:
        engine.server.request("POST", "/sleep?level=1", timeout_s=600)
    began = time.perf_counter()
    metrics = trainer.update(traj, advantages, rollout=engine)
    update_s = time.perf_counter() - began
    used_update = device_used_gib()
    if args.sleep:
        engine.server.request("POST", "/wake_up", timeout_s=600)
    trainer.mark_synced()
    engine.update_weights(trainer.policy_version)
    step_s = time.perf_counter() - started
    tokens = int(traj.lengths.sum())
    return {
        "step": step,
        "samples": len(traj),
        "generated_tokens": tokens,
        "rollout_s": rollout_s,
        "rollout_tokens_per_s": tokens / rollout_s,
        "update_s": update_s,
        "weight_sync_s": engine.last_sync_s,
        "step_s": step_s,
        "samples_per_gpu_per_s": len(traj) / step_s,
        "logprob_abs_diff_mean": metrics.get("rollout_corr/logprob_abs_diff_mean"),
        "logprob_abs_diff_max": metrics.get("rollout_corr/logprob_abs_diff_max"),
        "pg_loss": metrics.get("actor/pg_loss"),
        "trainer_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "device_used_after_rollout_gib": used_rollout,
        "device_used_after_update_gib": used_update,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny Qwen3, fp32, short responses")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--layers", type=int, default=48, help="text layers of the real-size backbone")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    parser.add_argument("--sleep", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    smoke = args.smoke
    args.steps = args.steps or (2 if smoke else 5)
    args.max_new_tokens = args.max_new_tokens or (16 if smoke else 1024)
    args.sleep = (not smoke) if args.sleep is None else args.sleep
    if smoke:
        args.prompts, args.group_size = min(args.prompts, 2), min(args.group_size, 4)
    work = tempfile.mkdtemp(prefix="vllm_ar_")
    from diffrl.models.tiny import build_tiny

    if smoke:
        policy = CausalLMPolicy.from_pretrained(build_tiny("qwen3", os.path.join(work, "model"), seed=0))
    else:
        policy = realsize_policy(realsize_folder(os.path.join(work, "model"), args.layers), "cuda")
    sampling = TokenSampling(
        max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0, batch_size=args.prompts * args.group_size
    )
    train = TrainConfig(
        lora_rank=args.lora_rank,
        lora_alpha=2 * args.lora_rank,
        lora_init="default",
        lr=1e-5,
        mini_batch_prompts=args.prompts,
        micro_batch_size=2 if smoke else 4,
        gradient_checkpointing=not smoke,
    )
    trainer = TokenTrainer(policy, get_algorithm("gspo"), train, sampling, group_size=args.group_size)
    context = 64 + args.max_new_tokens
    options = VllmRolloutOptions(
        dtype="float32" if smoke else "bfloat16",
        load_format="auto" if smoke else "dummy",
        enforce_eager=smoke,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=context,
        max_num_seqs=args.prompts * args.group_size,
        max_num_batched_tokens=max(2048, context),
        max_lora_rank=args.lora_rank,
        dev_mode=args.sleep,
        start_timeout_s=1800,
        request_timeout_s=3600,
        concurrency=args.prompts,
        extra_args=("--enable-sleep-mode",) if args.sleep else (),
    )
    started = time.perf_counter()
    engine = VllmTokenEngine(policy, options, weights_dir=os.path.join(work, "weights"), python=vllm_python()).start()
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "args": vars(args),
        "server_start_s": time.perf_counter() - started,
        "steps": [],
    }
    try:
        for step in range(args.steps):
            result["steps"].append(one_step(engine, trainer, sampling, args, step))
            print(json.dumps(result["steps"][-1]), flush=True)
    finally:
        engine.close()
    kept = result["steps"][args.warmup :] or result["steps"]
    keys = ("rollout_tokens_per_s", "samples_per_gpu_per_s", "weight_sync_s", "update_s", "rollout_s", "step_s")
    result["median"] = {k: statistics.median(s[k] for s in kept) for k in keys}
    result["logprob_gap_note"] = None if smoke else "dummy server weights vs random trainer weights: not numerics"
    print(json.dumps(result["median"], indent=2))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
