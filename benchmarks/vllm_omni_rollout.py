"""The vLLM-Omni GPU attempt: does vLLM-Omni start and sample a real-size diffusion model on this
machine, and how fast. Records a result or the exact failure; nothing here runs on a CPU (vllm-omni has no CPU
platform).

    # the offline bundles (tools/vllm-omni-bundle/README.md), carried one piece per call, then unpacked:
    mkdir -p /tmp/pieces && cp piece-K/* /tmp/pieces/          # vllm's vllm.tar.xz.* and omni's omni.tar.xz.*
    mkdir -p /tmp/vsite && cat /tmp/pieces/vllm.tar.xz.* | tar -C /tmp/vsite -xJ
    mkdir -p /tmp/omni-site && cat /tmp/pieces/omni.tar.xz.* | tar -C /tmp/omni-site -xJ
    export DIFFRL_VLLM_OMNI_PYTHON=python3 DIFFRL_VLLM_OMNI_PYTHONPATH=/tmp/omni-site:/tmp/vsite  # omni first
    python -m benchmarks.vllm_omni_rollout --out benchmarks/results/vllm_omni_rollout_h200.json

1. diffrl writes SD3.5-Medium at real size with random weights (`diffrl random-model sd35m`, 16 GB) unless
   --model names a folder (Qwen-Image's 58 GB nearly fill the GPU machine's 64 GB disk).
2. A child process in vLLM-Omni's environment (it pins diffusers 0.38 / accelerate 1.12, so it cannot import diffrl's
   diffusers 0.42; the child imports no diffrl) builds `vllm_omni.entrypoints.omni.Omni(model=folder)` and samples
   `--batches` x `--batch` images with `OmniDiffusionSamplingParams` (height, width, num_inference_steps, seed,
   guidance_scale, num_outputs_per_prompt), vLLM-Omni's stock pipeline and scheduler (ODE: no log-probs).
3. The JSON holds the versions, the start seconds, images/s after the first batch, or the failing stage with the
   exception's last lines. Log-prob agreement with diffrl's sampler needs diffrl's SDE pipeline inside vLLM-Omni's
   worker (diffrl/engines/rollout/vllm_omni.py: the step it would take, not the worker class), so it is recorded as
   not attempted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

CHILD_TIMEOUT_S = 1800


def child(args: argparse.Namespace) -> dict:
    """Runs in vLLM-Omni's environment: start the engine, sample, time it. Imports nothing of diffrl."""
    result: dict = {"stage": "import"}
    try:
        import torch
        import vllm_omni
        from vllm_omni.entrypoints.omni import Omni
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        result.update(
            vllm_omni=getattr(vllm_omni, "__version__", "?"),
            torch=torch.__version__,
            device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            stage="start",
        )
        began = time.perf_counter()
        omni = Omni(model=args.model)
        result["start_s"] = time.perf_counter() - began
        result["stage"] = "generate"
        times = []
        for b in range(args.batches):
            params = OmniDiffusionSamplingParams(
                height=args.size,
                width=args.size,
                num_inference_steps=args.steps,
                seed=1000 + b,
                guidance_scale=args.guidance_scale,
                num_outputs_per_prompt=args.batch,
            )
            began = time.perf_counter()
            outputs = omni.generate({"prompt": "a photo of a red bicycle next to a blue door"}, params)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
            result["outputs_type"] = type(outputs).__name__
        kept = times[1:] or times
        result.update(stage="done", batch_s=times, images_per_s=args.batch * len(kept) / sum(kept))
        # the diffusion worker holds the GPU memory, not this process: read the device's use (nvidia-smi)
        result["gpu_memory_used_mib"] = _gpu_memory_used_mib()
    except BaseException as e:  # the attempt's purpose is to record the exact failure
        result.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help="a diffusers folder (default: random SD3.5-Medium)")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--guidance-scale", type=float, default=4.5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    result: dict = {
        "args": vars(args),
        "logprob_agreement": "not attempted: diffrl's SDE pipeline for vLLM-Omni's "
        "worker is not written (docs/models.md)",
    }
    if args.model is None:
        args.model = os.path.join(tempfile.mkdtemp(prefix="omni_"), "sd35m")
        began = time.perf_counter()
        made = subprocess.run(
            [
                sys.executable,
                "-m",
                "diffrl",
                "random-model",
                "sd35m",
                args.model,
                "--device",
                "cuda",
                "--dtype",
                "bf16",
            ],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
        result["random_model_s"] = time.perf_counter() - began
        if made.returncode != 0:
            result["error"] = f"diffrl random-model failed: {made.stderr[-2000:]}"
            return _write(result, args.out)
    python = os.environ.get("DIFFRL_VLLM_OMNI_PYTHON", sys.executable)
    if not os.path.isfile(os.path.join(args.model, "model_index.json")):
        raise SystemExit(f"--model {args.model}: no model_index.json there (vLLM-Omni would take it for a Hub id)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # the vllm bundle leaves out vllm's FA2 kernels (TRIM_VLLM=1), which vLLM-Omni's default diffusion attention calls
    env.setdefault("DIFFUSION_ATTENTION_BACKEND", "TORCH_SDPA")
    result["diffusion_attention_backend"] = env["DIFFUSION_ATTENTION_BACKEND"]
    if os.environ.get("DIFFRL_VLLM_OMNI_PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["DIFFRL_VLLM_OMNI_PYTHONPATH"]
    cmd = [
        python,
        os.path.abspath(__file__),
        "--child",
        "--model",
        args.model,
        "--size",
        str(args.size),
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--batches",
        str(args.batches),
        "--guidance-scale",
        str(args.guidance_scale),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        result["omni"] = (
            json.loads(lines[-1][7:]) if lines else {"error": f"exit {done.returncode}", "stderr": done.stderr[-4000:]}
        )
    except subprocess.TimeoutExpired:
        result["omni"] = {"error": f"no result within {CHILD_TIMEOUT_S} s"}
    _write(result, args.out)


def _gpu_memory_used_mib() -> int | None:
    """The device's used memory in MiB (nvidia-smi; None without it)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return int(done.stdout.split()[0]) if done.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def _write(result: dict, out: str | None) -> None:
    print(json.dumps(result, indent=2))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
