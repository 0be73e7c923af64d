"""`diffrl tiny-model`: write a tiny random-weight diffusers pipeline folder (no network needed), e.g.

    diffrl tiny-model sd3 ./tiny_sd3 --seed 0
    diffrl sample ./tiny_sd3 --prompt "a red cube" --steps 4 --height 64 --width 64 --out cube.png

The folder loads with `DiffusionPipeline.from_pretrained(OUT_DIR)` offline; the same seed gives the
same weights. Exit codes: 0 written, 2 bad input (one-line error on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers the `tiny-model` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "tiny-model",
        help="build a tiny random-weight pipeline folder for tests and the quickstart",
        description=(
            "Build the whole pipeline of an architecture (transformer, VAE, text encoders, tokenizers built "
            "in memory, scheduler) at tiny size with random weights, deterministic for --seed, and save it as "
            "an ordinary diffusers folder. Nothing is downloaded."
        ),
        epilog="example: diffrl tiny-model sd3 ./tiny_sd3 --seed 0",
    )
    parser.add_argument(
        "arch",
        metavar="ARCH",
        help="architecture: sd3, qwen_image, qwen_image_edit, qwen_image21, flux, flux_kontext, flux2 (FLUX.2-klein), "
        "wan, z_image (or wan22, wan_i2v), hunyuan_video15, qwen3_omni, bagel, hunyuan_image3",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (created; existing files are replaced)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Builds and saves the tiny pipeline; prints the folder; returns the exit code."""
    from diffrl.models.tiny import build_tiny

    if os.path.isfile(args.out_dir):
        print(f"diffrl tiny-model: error: OUT_DIR {args.out_dir!r} is a file, expected a folder", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        path = build_tiny(args.arch, args.out_dir, seed=args.seed)
    except ValueError as e:
        print(f"diffrl tiny-model: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(path)
    return EXIT_OK
