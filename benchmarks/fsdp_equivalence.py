"""FSDP2 equivalence on GPUs: 2 processes (NCCL) train to the same LoRA weights and metrics as 1 process.

The GPU counterpart of tests/engines/train/test_fsdp.py (CPU, gloo, fp32, <= 1e-5): the same worker
(tests/engines/train/fsdp_worker.py: a tiny SD3 model, 4 trajectories, two FlowGRPO updates with KL,
mini-batches of one prompt, micro-batches of one sample) run once plainly and once under torchrun with 2
GPUs, in `--dtype` (bf16 by default, or fp32 with TF32 off).

What "the same" means in bf16: a third run, 1 process with micro-batches of 2 samples, computes the very
same update with only the order of its gradient sums changed -- the noise floor of bf16 arithmetic. The
2-process run is equivalent when its difference from the 1-process run is no larger than
`--floor-factor` x that floor (weights: relative norm of the LoRA B difference; metrics: relative). In
fp32 the bar is absolute: `--atol` (1e-5, the CPU test's).

    python -m benchmarks.fsdp_equivalence --out benchmarks/results/fsdp_equivalence_h200x2.json              # bf16
    python -m benchmarks.fsdp_equivalence --dtype fp32 --out benchmarks/results/fsdp_equivalence_fp32_h200x2.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "engines", "train", "fsdp_worker.py")

METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ratio_mean")


def _run(args: list[str]) -> None:
    done = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
        },
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-4000:]}")


def compare(one: str, two: str) -> dict:
    """Largest |w2 - w1| over the trainable tensors, the largest |w1| of LoRA B (the update's size:
    B starts at 0), and per metric the largest relative difference over the two updates."""
    w1, w2 = load_file(os.path.join(one, "weights.safetensors")), load_file(os.path.join(two, "weights.safetensors"))
    if w1.keys() != w2.keys() or not w1:
        raise SystemExit("the two runs saved different (or no) trainable tensors")
    weight_diff = max(float((w2[k].float() - w1[k].float()).abs().max()) for k in w1)
    lora_b = [k for k in w1 if "lora_B" in k]
    update = max(float(w1[k].float().abs().max()) for k in lora_b)
    # B starts at 0, so |B| is the update: the difference relative to it, over all B tensors together
    diff_norm = sum(float((w2[k].float() - w1[k].float()).norm()) ** 2 for k in lora_b) ** 0.5
    update_norm = sum(float(w1[k].float().norm()) ** 2 for k in lora_b) ** 0.5
    with open(os.path.join(one, "metrics.json")) as f1, open(os.path.join(two, "metrics.json")) as f2:
        m1, m2 = json.load(f1), json.load(f2)
    metric_diff = {
        name: max(abs(a[name] - b[name]) / max(1.0, abs(a[name])) for a, b in zip(m1, m2)) for name in METRICS
    }
    return {
        "max_abs_weight_diff": weight_diff,
        "max_abs_lora_B": update,
        "lora_B_rel_norm_diff": diff_norm / update_norm,
        "metric_max_rel_diff": metric_diff,
        "metrics_1_process": m1,
        "metrics_2_processes": m2,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument(
        "--atol",
        type=float,
        default=1e-5,
        help="fp32: largest relative metric difference and LoRA B relative norm difference",
    )
    parser.add_argument(
        "--floor-factor", type=float, default=2.0, help="bf16: allowed multiple of the reduction-order noise floor"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs; torch sees {torch.cuda.device_count()}")
    from diffrl.models.tiny import build_tiny

    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "tiny-sd3")
        build_tiny("sd3", model, seed=0)
        one, two, reordered = (os.path.join(tmp, name) for name in ("one", "two", "one_micro2"))
        for path in (one, two, reordered):
            os.makedirs(path)
        _run([sys.executable, WORKER, model, one, args.device, args.dtype, "1"])
        _run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                WORKER,
                model,
                two,
                args.device,
                args.dtype,
                "1",
            ]
        )
        _run([sys.executable, WORKER, model, reordered, args.device, args.dtype, "2"])
        result = compare(one, two)
        floor = compare(one, reordered)
    result["noise_floor"] = {
        k: floor[k] for k in ("max_abs_weight_diff", "lora_B_rel_norm_diff", "metric_max_rel_diff")
    }
    # Elementwise, Adam's first steps move each weight by about +-lr whatever its gradient's size, so a
    # near-zero gradient whose sign the summation order flips moves a weight the other way: the weights
    # are compared as a whole (relative norm of the LoRA B difference), next to the floor.
    if args.dtype == "fp32":
        bar = {"lora_B_rel_norm_diff": args.atol, **{name: args.atol for name in METRICS}}
    else:
        bar = {
            "lora_B_rel_norm_diff": args.floor_factor * floor["lora_B_rel_norm_diff"],
            **{name: args.floor_factor * max(floor["metric_max_rel_diff"][name], 1e-6) for name in METRICS},
        }
    result["bar"] = bar
    result["equivalent"] = result["lora_B_rel_norm_diff"] <= bar["lora_B_rel_norm_diff"] and all(
        result["metric_max_rel_diff"][n] <= bar[n] for n in METRICS
    )
    result.update(
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        backend="nccl" if args.device == "cuda" else "gloo",
        dtype=args.dtype,
        torch=torch.__version__,
        command=" ".join(["python", "-m", "benchmarks.fsdp_equivalence", *(argv or sys.argv[1:])]),
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("metrics_")}, indent=2))
    return result


if __name__ == "__main__":
    main()
