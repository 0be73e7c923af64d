"""Benchmark: diffrl's rollout sampler vs diffusers' `StableDiffusion3Pipeline` on SD3.5-Medium.

Random weights at real size (SD3.5-Medium transformer, 16-channel SD3 VAE) in bf16; text encoding is
excluded: both sides get the same random prompt embeddings of the real shapes (CLIP-L+G 77 tokens + T5
256 tokens = 333 x 4096, pooled 2048). Both sample 512x512, 10 steps, CFG 4.5, batch 16 after warm-up
and decode to uint8/np images. Our engine is timed as the RL rollout runs it (SDE noise level 0.7 on
every step but the last, log-probs, fp32 latents copied to CPU) and also at noise level 0.

    python -m benchmarks.sampler_vs_diffusers                      # GPU: writes benchmarks/results/...json
    python -m benchmarks.sampler_vs_diffusers --tiny --device cpu  # smoke check (nothing recorded)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)

from benchmarks.common import TINY_SCALES, PrecomputedEmbeddings
from diffrl.configs.rollout import SamplingConfig
from diffrl.engines.rollout import RolloutEngine
from diffrl.models.sd3.adapter import SD3Adapter
from diffrl.models.sd3.realsize import SD35M_SCHEDULER, SD35M_TRANSFORMER, SD35M_VAE

# The published SD3.5-Medium configs (diffrl/models/sd3/realsize.py).
SD35_MEDIUM_TRANSFORMER, SD3_VAE, SD3_SCHEDULER = SD35M_TRANSFORMER, SD35M_VAE, SD35M_SCHEDULER
TEXT_TOKENS = 77 + 256  # CLIP + T5 at the pipeline's default max_sequence_length

# --tiny: the same classes at smoke-test size (the sizes rl_step's --tiny uses)
TINY_TRANSFORMER = dict(SD35_MEDIUM_TRANSFORMER, **TINY_SCALES["sd3"]["transformer"])
TINY_VAE = dict(SD3_VAE, **TINY_SCALES["sd3"]["vae"])


def build_pipeline(tiny: bool, device: str, dtype: torch.dtype) -> StableDiffusion3Pipeline:
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds instead of minutes for 2.2 B params
        transformer = SD3Transformer2DModel(**(TINY_TRANSFORMER if tiny else SD35_MEDIUM_TRANSFORMER))
        vae = AutoencoderKL(**(TINY_VAE if tiny else SD3_VAE))
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device=device, dtype=dtype)


def random_embeddings(pipe, batch: int, device: str, dtype: torch.dtype):
    """(B, 333, D) prompt and negative embeddings and their (B, P) pooled ones, seeded."""
    cfg = pipe.transformer.config
    g = torch.Generator().manual_seed(1)
    shapes = [(batch, TEXT_TOKENS, cfg.joint_attention_dim), (batch, cfg.pooled_projection_dim)] * 2
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]


def time_interleaved(fns: dict, repeats: int, device: str) -> dict[str, float]:
    """Median seconds of each fn() over `repeats` rounds; rounds interleave the fns so that clock or
    thermal drift affects all of them alike (synchronised on CUDA)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny random model (smoke check; nothing recorded)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--guidance-scale", type=float, default=4.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time both with the transformer blocks torch.compiled (model.compile: true)",
    )
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    resolution = 64 if args.tiny else args.resolution
    pipe = build_pipeline(args.tiny, args.device, dtype)
    pos, pooled, neg, neg_pooled = random_embeddings(pipe, args.batch, args.device, dtype)
    seeds = list(range(args.batch))

    def run_pipeline():
        pipe(
            prompt_embeds=pos,
            pooled_prompt_embeds=pooled,
            negative_prompt_embeds=neg,
            negative_pooled_prompt_embeds=neg_pooled,
            guidance_scale=args.guidance_scale,
            num_inference_steps=args.steps,
            height=resolution,
            width=resolution,
            output_type="np",
            generator=[torch.Generator().manual_seed(s) for s in seeds],
        )

    prompts = [f"prompt {i}" for i in range(args.batch)]
    table = {
        p: {"prompt_embeds": pos[i : i + 1], "pooled_prompt_embeds": pooled[i : i + 1]} for i, p in enumerate(prompts)
    }
    table[""] = {"prompt_embeds": neg[:1], "pooled_prompt_embeds": neg_pooled[:1]}
    adapter = SD3Adapter(pipe, device=args.device, dtype=dtype)
    engine = RolloutEngine(adapter, cache=PrecomputedEmbeddings(table), progress=False)

    def run_engine(noise_level: float, attention: str = "default"):
        adapter.attention = attention
        cfg = SamplingConfig(
            num_inference_steps=args.steps,
            height=resolution,
            width=resolution,
            guidance_scale=args.guidance_scale,
            noise_level=noise_level,
            batch_size=args.batch,
        )
        engine.generate(prompts, prompts, [0] * args.batch, seeds, cfg)

    runs = {
        "diffusers": run_pipeline,
        "diffrl_sde": lambda: run_engine(0.7),
        "diffrl_ode": lambda: run_engine(0.0),
        # the same engine with cuDNN attention first (model.attention: cudnn)
        "diffrl_sde_cudnn_attention": lambda: run_engine(0.7, "cudnn"),
    }
    for fn in runs.values():  # warm-up
        fn()
    seconds = time_interleaved(runs, args.repeats, args.device)
    if args.compile:
        # model.compile: true. The engine's adapter shares the pipeline's transformer, so this compiles the
        # diffusers pipeline's blocks too: both are timed again, and the headline ratio stays against the
        # stock (eager) pipeline.
        started = time.perf_counter()
        adapter.compile_blocks()
        compiled = {"diffrl_sde_compiled": lambda: run_engine(0.7), "diffusers_compiled": run_pipeline}
        for fn in compiled.values():  # warm-up: the compile itself
            fn()
        compile_seconds = time.perf_counter() - started
        seconds.update(time_interleaved(compiled, args.repeats, args.device))
    ips = {k: args.batch / v for k, v in seconds.items()}
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    import diffusers

    result = {
        "device": device_name,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "model": "tiny SD3 (smoke check)" if args.tiny else "SD3.5-Medium size, random weights, bf16",
        "resolution": resolution,
        "steps": args.steps,
        "guidance_scale": args.guidance_scale,
        "batch": args.batch,
        "repeats": args.repeats,
        "images_per_s": {
            "diffusers_pipeline": ips["diffusers"],
            "diffrl_rollout_sde_0.7": ips["diffrl_sde"],
            "diffrl_rollout_ode": ips["diffrl_ode"],
            "diffrl_rollout_sde_0.7_cudnn_attention": ips["diffrl_sde_cudnn_attention"],
        },
        "ratio": ips["diffrl_sde"] / ips["diffusers"],
        "ratio_ode": ips["diffrl_ode"] / ips["diffusers"],
        "ratio_cudnn_attention": ips["diffrl_sde_cudnn_attention"] / ips["diffusers"],
        **(
            {
                "images_per_s_compiled": {
                    "diffusers_pipeline": ips["diffusers_compiled"],
                    "diffrl_rollout_sde_0.7": ips["diffrl_sde_compiled"],
                },
                "ratio_compiled_vs_eager_diffusers": ips["diffrl_sde_compiled"] / ips["diffusers"],
                "ratio_compiled_vs_compiled_diffusers": ips["diffrl_sde_compiled"] / ips["diffusers_compiled"],
                "compile_and_warmup_s": compile_seconds,
            }
            if args.compile
            else {}
        ),
        "command": " ".join(
            ["python", "-m", "benchmarks.sampler_vs_diffusers", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    print(json.dumps(result, indent=2))
    if not args.tiny:
        slug = re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, f"sampler_vs_diffusers_{slug}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
