"""`diffrl score`: score image files with one reward, e.g.

    diffrl score --reward ocr --prompt 'A sign saying "Hidden Trail"' --json sign.png
    diffrl score --reward clip_score --option model_path=/models/clip-vit-l14 --prompt "a cat" *.png

stdout carries only the result (one `score<TAB>image` line per image, or with --json a JSON list
of {"image": ..., "score": ...}; an excluded sample has score null); logs go to stderr.
Exit codes: 0 scored, 1 a reward failed at run time (server down, ...), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import numpy as np

logger = logging.getLogger("diffrl.score")

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers the `score` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "score",
        help="score image files with one reward function",
        description=(
            "Score image files with one reward function (ocr, jpeg_compressibility, clip_score, "
            "vlm_judge, ...). Prints one score per image to stdout; logs go to stderr. "
            "Reward options (weight folders, server URLs) are given as --option key=value."
        ),
        epilog="example: diffrl score --reward ocr --prompt 'A sign saying \"Hidden Trail\"' --json sign.png",
    )
    parser.add_argument("--reward", required=True, help="a registered reward (e.g. ocr) or your module:function")
    parser.add_argument("--prompt", default="", help="the prompt the images were generated from (same for all)")
    parser.add_argument("--ground-truth", default=None, help="target text (metadata['ground_truth'], e.g. for ocr)")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a reward option, repeatable (e.g. --option model_path=/models/clip)",
    )
    parser.add_argument("--json", action="store_true", help='print a JSON list of {"image": ..., "score": ...}')
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="image files (PNG, JPEG, ...)")
    parser.set_defaults(func=run)
    return parser


def parse_option_pairs(pairs: list[str]) -> dict[str, str]:
    """['a=1', 'b=x'] -> {'a': '1', 'b': 'x'}; values are converted by the reward's options type."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--option must be KEY=VALUE, got {pair!r}")
        options[key.strip()] = value
    return options


def load_image(path: str) -> np.ndarray:
    """An image file -> RGB uint8 (H, W, 3)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))
    except (OSError, UnidentifiedImageError) as e:
        raise ValueError(f"cannot read image {path!r}: {e}") from None


def run(args: argparse.Namespace) -> int:
    """Scores args.images one by one (they may differ in size); returns the exit code."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    from diffrl.engines.reward.base import RewardError, build_reward

    metadata = {} if args.ground_truth is None else {"ground_truth": args.ground_truth}
    try:
        reward = build_reward(args.reward, parse_option_pairs(args.option))
        images = [load_image(path) for path in args.images]
    except ValueError as e:
        print(f"diffrl score: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    results = []
    try:
        for path, image in zip(args.images, images):
            output = reward(image[None], [args.prompt], [dict(metadata)])
            valid = bool(output.valid[0])
            if not valid:
                logger.warning("%s: excluded by %s: %s", path, args.reward, output.info)
            results.append({"image": path, "score": float(output.scores[0]) if valid else None})
    except ValueError as e:  # e.g. no target text for ocr
        print(f"diffrl score: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RewardError as e:
        print(f"diffrl score: {e}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(results))
    else:
        for result in results:
            print(f"{'excluded' if result['score'] is None else format(result['score'], '.6g')}\t{result['image']}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m flows.commands.score ...`); `diffrl score` is the usual one."""
    parser = argparse.ArgumentParser(prog="diffrl")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["score", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
