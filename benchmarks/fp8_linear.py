"""Micro-benchmark of rollout.weights kind fp8: a bf16 nn.Linear forward vs the FP8 linear of
diffrl/engines/rollout/fast_weights.py (weight quantized once, the input per call, per-row scales), eager and under
torch.compile, at the transformer's linear shapes.

Legend: M tokens of a forward (batch x sequence), K in features, N out features; FLOPs 2 M K N.

Reports per shape: ms, TFLOP/s and speed-up of each path, the max/mean relative error of the FP8 output vs the bf16
one, and of ``torch._scaled_mm`` vs the emulated path (the same quantized operands). On the CPU (or a GPU below
compute capability 8.9) only the emulated path runs, at a tiny shape: a smoke test, not a speed figure.

  python -m benchmarks.fp8_linear --out benchmarks/results/fp8_linear_h200.json
  python -m benchmarks.fp8_linear --device cpu --shapes 64x32x48 --repeats 2   # smoke test
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import common
from diffrl.engines.rollout.fast_weights import fp8_linear, quantize_rows, scaled_mm_supported

# Qwen-Image (hidden 3072, MLP 12288) at 32768 tokens; SD3.5-Medium (hidden 1536, MLP 6144) at 49152 tokens
DEFAULT_SHAPES = "32768x3072x3072,32768x3072x12288,32768x12288x3072,49152x1536x1536,49152x1536x6144,49152x6144x1536"


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """`MxKxN,...` -> [(M, K, N), ...]; K and N must be multiples of 16 (the FP8 matmul's alignment)."""
    shapes = []
    for item in filter(None, text.split(",")):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--shapes takes MxKxN items (e.g. 32768x3072x3072); got {item!r}")
        m, k, n = map(int, parts)
        if k % 16 or n % 16:
            raise ValueError(f"--shapes {item}: K and N must be multiples of 16")
        shapes.append((m, k, n))
    return shapes


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """max and mean of |out - reference| / max(|reference|) per row (a row's scale, so near-zero outputs don't
    dominate)."""
    diff, scale = (out.float() - reference.float()).abs(), reference.float().abs().amax(dim=-1, keepdim=True)
    rel = diff / scale.clamp_min(1e-12)
    return {"max": float(rel.max()), "mean": float(rel.mean())}


def measure_shape(m: int, k: int, n: int, args) -> dict:
    """One (M, K, N): the paths' times and errors."""
    device, dtype = args.device, torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    linear = torch.nn.Linear(k, n, device=device, dtype=dtype)
    x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
    w_fp8, w_scale = quantize_rows(linear.weight.detach())
    bias = linear.bias.detach()
    fast = scaled_mm_supported(torch.device(device))
    paths = {
        "linear": lambda x: torch.nn.functional.linear(x, linear.weight, bias),
        "fp8_emulated": lambda x: fp8_linear(x, w_fp8, w_scale, bias, scaled_mm=False),
    }
    if fast:
        paths["fp8_scaled_mm"] = lambda x: fp8_linear(x, w_fp8, w_scale, bias, scaled_mm=True)
    flops = 2 * m * k * n
    row: dict = {"M": m, "K": k, "N": n, "dtype": str(dtype), "scaled_mm": fast, "paths": {}}
    outputs = {}
    with torch.no_grad():
        for mode in ("eager", "compiled") if args.compile else ("eager",):
            for name, fn in paths.items():
                run = torch.compile(fn) if mode == "compiled" else fn
                outputs[(mode, name)] = run(x)
                seconds = common.time_median(lambda: run(x), repeats=args.repeats, warmup=args.warmup, device=device)
                row["paths"][f"{name}_{mode}"] = {"ms": 1e3 * seconds, "tflops": flops / seconds / 1e12}
    base = row["paths"]["linear_eager"]["ms"]
    for entry in row["paths"].values():
        entry["speedup_vs_linear_eager"] = base / entry["ms"]
    reference = outputs[("eager", "linear")]
    row["error_fp8_emulated_vs_linear"] = relative_error(outputs[("eager", "fp8_emulated")], reference)
    if fast:
        row["error_fp8_scaled_mm_vs_linear"] = relative_error(outputs[("eager", "fp8_scaled_mm")], reference)
        row["error_scaled_mm_vs_emulated"] = relative_error(
            outputs[("eager", "fp8_scaled_mm")], outputs[("eager", "fp8_emulated")]
        )
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of MxKxN")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="time eager only")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = parser.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    device_name = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu"
    result = {
        "device": device_name,
        "torch": torch.__version__,
        "command": " ".join(["python", "-m", "benchmarks.fp8_linear", *(sys.argv[1:] if argv is None else argv)]),
        "shapes": [],
    }
    for m, k, n in shapes:
        row = measure_shape(m, k, n, args)
        result["shapes"].append(row)
        common.write_json(args.out, result)
        times = "  ".join(
            f"{name} {p['ms']:.3f} ms ({p['speedup_vs_linear_eager']:.2f}x)" for name, p in row["paths"].items()
        )
        error = row["error_fp8_emulated_vs_linear"]["max"]
        print(f"M={m} K={k} N={n}: {times}; fp8 vs linear max rel. error {error:.4f}", flush=True)
    return result


if __name__ == "__main__":
    main()
