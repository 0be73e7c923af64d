"""`diffrl random-model`: write a REAL-size random-weight diffusers pipeline folder (no network needed), e.g.

    diffrl random-model sd35m /data/sd35m-random --device cuda --dtype bf16 --seed 0
    diffrl train sd35m_flow_grpo_ocr model.path=/data/sd35m-random

    diffrl random-model qwen_image /data/qwen-image-configs --configs-only
    diffrl train qwen_image_ocr_lora model.path=random:/data/qwen-image-configs

    diffrl random-model wan22_a14b /data/wan22-configs --configs-only
    diffrl train wan22_dance_grpo model.path=random:/data/wan22-configs

    diffrl random-model wan22_i2v_a14b /data/wan22-i2v-configs --configs-only
    diffrl train wan22_i2v_flow_grpo model.path=random:/data/wan22-i2v-configs

    diffrl random-model hunyuan_video15_480p /data/hv15-random --device cuda --dtype bf16
    diffrl train hunyuan_video15_flow_grpo model.path=/data/hv15-random

    diffrl random-model ltx2 /data/ltx2-configs --configs-only
    diffrl train ltx2_flow_grpo model.path=random:/data/ltx2-configs

    diffrl random-model hunyuan_image3 /data/hunyuan-image3-configs --configs-only

The folder has the layout and shapes of stabilityai/stable-diffusion-3.5-medium ("sd35m"), Qwen/Qwen-Image
("qwen_image"), Wan-AI/Wan2.2-T2V-A14B-Diffusers ("wan22_a14b": two experts) or Wan-AI/Wan2.2-I2V-A14B-Diffusers
("wan22_i2v_a14b": two image-to-video experts) or hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v
("hunyuan_video15_480p"), so training and sampling cost what they cost with the real checkpoint,
on a machine with no hub access. Weights are random (seeded); tokenizers are built in memory. Sizes in bf16: ~16.3 GB
(sd35m), ~57.7 GB (qwen_image), ~68.8 GB (wan22_a14b, wan22_i2v_a14b: more than a 64 GB disk holds), ~33.8 GB
(hunyuan_video15_480p); the free disk space is checked first. With --configs-only the folder holds configs,
tokenizers and the scheduler (a few MB, written in seconds) and `model.path=random:OUT_DIR` builds the weights in
memory on the run's device instead (the same shapes and compute, nothing read from disk).
Exit codes: 0 written, 2 bad input (one-line error on stderr).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

EXIT_OK, EXIT_BAD_INPUT = 0, 2
# architectures in their own (non-diffusers) layout: configs only, each module's write_config_folder(out_dir)
CONFIGS_ONLY = {"bagel": "diffrl.models.bagel.realsize", "hunyuan_image3": "diffrl.models.hunyuan_image3.realsize"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers the `random-model` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "random-model",
        help="write a real-size random-weight pipeline folder (SD3.5-Medium, Qwen-Image, FLUX.2, Wan2.2 A14B "
        "T2V/I2V, HunyuanVideo-1.5, LTX-2, Stable Audio 3) for GPU runs",
        description=(
            "Build every component of a real pipeline (transformer, VAE, text encoders at their published "
            "sizes, tokenizers built in memory, scheduler) with random weights, one component at a time on "
            "--device in --dtype, and save it as an ordinary diffusers folder. Nothing is downloaded."
        ),
        epilog="example: diffrl random-model qwen_image /data/qwen-image-random --device cuda --dtype bf16",
    )
    parser.add_argument(
        "arch",
        metavar="ARCH",
        help="architecture: sd35m, qwen_image, qwen_image21, flux2_klein (FLUX.2-klein base 9B), flux2_klein_4b, "
        "flux2_dev (FLUX.2-dev 32B, 112.6 GB in bf16), wan22_a14b, wan22_i2v_a14b, hunyuan_video15_480p "
        "(HunyuanVideo-1.5 480p T2V), ltx2 (LTX-2 video with audio, 67.7 GB in bf16), stable_audio3_medium "
        "(Stable Audio 3 text-to-audio), bagel (BAGEL-7B-MoT; "
        "--configs-only) or hunyuan_image3 (HunyuanImage-3.0, 80 B; --configs-only)",
    )
    parser.add_argument(
        "out_dir",
        metavar="OUT_DIR",
        help="folder to write (must not exist; written as OUT_DIR.tmp and renamed when complete)",
    )
    parser.add_argument(
        "--device", default="cuda", help="where weights are initialised: cuda, cuda:N or cpu (default cuda)"
    )
    parser.add_argument("--dtype", default="bf16", help="stored dtype: bf16, fp16 or fp32 (default bf16)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--configs-only",
        action="store_true",
        help="write no weights: configs, tokenizers and scheduler only, for model.path=random:OUT_DIR (weights "
        "built in memory on the run's device; Qwen-Image's 58 GB and Wan2.2 A14B's 69 GB would not fit a 64 GB disk)",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Builds and saves the real-size pipeline; prints the folder; returns the exit code."""
    from diffrl.models.realsize import DTYPES, build_random

    try:
        if os.path.isfile(args.out_dir):
            raise ValueError(f"OUT_DIR {args.out_dir!r} is a file, expected a new folder")
        if args.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {args.dtype!r}")
        if args.arch in CONFIGS_ONLY:  # not diffusers folders: their own layouts, configs only (models/*/realsize.py)
            if not args.configs_only:
                raise ValueError(
                    f"{args.arch}: only --configs-only is supported (train it with model.path=random:OUT_DIR)"
                )
            if os.path.exists(args.out_dir):
                raise ValueError(f"OUT_DIR {args.out_dir!r} exists; give a new folder")
            path = importlib.import_module(CONFIGS_ONLY[args.arch]).write_config_folder(args.out_dir)
        else:
            path = build_random(
                args.arch,
                args.out_dir,
                device="cpu" if args.configs_only else args.device,
                dtype=DTYPES[args.dtype],
                seed=args.seed,
                weights=not args.configs_only,
            )
    except ValueError as e:
        print(f"diffrl random-model: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(path)
    if args.configs_only:
        print(f"train it with model.path=random:{path}", file=sys.stderr)
    return EXIT_OK
