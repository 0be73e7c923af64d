"""`diffrl sample`: generate images, videos or audio from a diffusers model folder with diffrl's sampler, e.g.

    diffrl sample ./tiny_sd3 --prompt "a red cube" --steps 4 --height 64 --width 64 --seed 7 --out cube.png
    diffrl sample /models/sd3.5-medium --prompt "a cat" --guidance-scale 4.5 --batch 4 --out cats.png
    diffrl sample tiny:stable_audio3 --prompt "soft rain" --steps 8 --duration 2 --out rain.wav

A model that makes audio writes each sample's waveform as a 16-bit PCM WAV file (STEM.wav), besides its video when
it makes one.

With --noise-level 0 (the default) the output equals the upstream diffusers pipeline called with the
same prompt, seed, steps, size and guidance; sample i of --batch K uses seed S + i (the pipeline run
with that seed). With --noise-level > 0 every step but the last is an SDE step of --sde-type, as in
Flow-GRPO rollouts. Exit codes: 0 written, 2 bad input (one-line error on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_OK, EXIT_BAD_INPUT = 0, 2

# Defaults when --height/--width/--num-frames are not given (the Wan pipeline's own for videos).
IMAGE_SIZE = (512, 512)
VIDEO_SIZE = (480, 832, 81)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers the `sample` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "sample",
        help="generate images/videos/audio from a diffusers model folder",
        description=(
            "Generate images (PNG), videos (GIF, MP4 when imageio-ffmpeg is installed, plus PNG frames) or audio "
            "(WAV) from a diffusers pipeline folder (SD3/SD3.5, Qwen-Image, FLUX, Wan2.x, Z-Image, Stable Audio 3) "
            "with diffrl's rollout sampler. With --noise-level 0 the result equals the upstream diffusers pipeline."
        ),
        epilog='example: diffrl sample ./tiny_sd3 --prompt "a red cube" --steps 4 --height 64 --width 64 '
        "--out cube.png",
    )
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="diffusers pipeline folder (has model_index.json), or a name configs take: reference:<name> (a shipped "
        "model, e.g. reference:shapes-small) or tiny:<arch> (built offline, cached)",
    )
    parser.add_argument("--prompt", required=True, help="the text prompt")
    parser.add_argument(
        "--image", default=None, help="the input image (qwen_image_edit) or the video's first frame (wan_i2v)"
    )
    parser.add_argument(
        "--last-image", default=None, help="the video's last frame (wan_i2v first/last-frame-to-video; with --image)"
    )
    parser.add_argument(
        "--negative-prompt", default="", help="negative prompt (used by CFG-style models when guidance > 1; default '')"
    )
    parser.add_argument("--steps", type=int, default=28, help="number of denoising steps (default 28)")
    parser.add_argument("--height", type=int, default=None, help="image height in pixels (default 512; Wan 480)")
    parser.add_argument("--width", type=int, default=None, help="image width in pixels (default 512; Wan 832)")
    parser.add_argument("--num-frames", type=int, default=None, help="video frames (video models only; default 81)")
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds of audio (audio models only; default: the model's)"
    )
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=None,
        help="the model's own guidance knob (SD3/Wan/Z-Image CFG, Qwen-Image true CFG, "
        "FLUX distilled guidance); default: the model's default",
    )
    parser.add_argument(
        "--noise-level",
        type=float,
        default=0.0,
        help="SDE noise level eta (0 = deterministic, equals the diffusers pipeline)",
    )
    parser.add_argument("--sde-type", default="sde", help="sde (Flow-GRPO), cps or dance_sde (with --noise-level > 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first sample (sample i uses seed + i)")
    parser.add_argument("--batch", type=int, default=1, help="number of samples (default 1)")
    parser.add_argument(
        "--max-sequence-length",
        type=int,
        default=None,
        help="text tokens kept (longer prompts are truncated with a warning); default: the model's",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="model dtype (default: float32 on cpu, bfloat16 on cuda)",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="PATH",
        help="output file; with --batch K > 1 files are named STEM_{i}.png (videos STEM_{i}.gif, audio STEM_{i}.wav)",
    )
    parser.set_defaults(func=run)
    return parser


def output_stems(out: str, batch: int) -> list[str]:
    """Output path stems (no suffix): PATH's stem for one sample, STEM_{i} for several."""
    stem = os.path.splitext(out)[0]
    return [stem] if batch == 1 else [f"{stem}_{i}" for i in range(batch)]


def write_image(pixels, stem: str, out: str, batch: int) -> list[str]:
    """(H, W, 3) uint8 -> PNG (PATH itself when it ends in .png and batch is 1)."""
    from PIL import Image

    path = out if batch == 1 and out.lower().endswith(".png") else stem + ".png"
    Image.fromarray(pixels).save(path)
    return [path]


def write_video(frames, stem: str, fps: int = 16) -> list[str]:
    """(F, H, W, 3) uint8 -> STEM.gif, STEM.mp4 (when imageio-ffmpeg is importable), STEM_frames/*.png."""
    from PIL import Image

    images = [Image.fromarray(f) for f in frames]
    written = [stem + ".gif"]
    images[0].save(written[0], save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
    try:
        import imageio.v2 as imageio
        import imageio_ffmpeg  # noqa: F401  (the MP4 writer backend)
    except ImportError:
        pass  # MP4 is optional; GIF and PNG frames are always written
    else:
        imageio.mimwrite(stem + ".mp4", list(frames), fps=fps)
        written.append(stem + ".mp4")
    frame_dir = stem + "_frames"
    os.makedirs(frame_dir, exist_ok=True)
    for k, image in enumerate(images):
        image.save(os.path.join(frame_dir, f"{k:04d}.png"))
    written.append(frame_dir + "/")
    return written


def write_audio(waveform_CT, stem: str, out: str, batch: int, sample_rate: int) -> list[str]:
    """(C, T) float waveform in [-1, 1] -> 16-bit PCM WAV (PATH itself when it ends in .wav and batch is 1)."""
    from diffrl.models.wav import write_wav

    path = out if batch == 1 and out.lower().endswith(".wav") else stem + ".wav"
    write_wav(path, waveform_CT, sample_rate)
    return [path]


def _device_and_dtype(args: argparse.Namespace):
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or ("float32" if str(device).startswith("cpu") else "bfloat16")
    return device, getattr(torch, dtype_name)


def _config(args: argparse.Namespace, is_video: bool, has_audio: bool = False):
    from diffrl.algorithms.windows import WindowPolicy
    from diffrl.configs.rollout import SamplingConfig

    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1; got {args.batch}")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1; got {args.steps}")
    if args.num_frames is not None and not is_video and args.num_frames != 1:
        raise ValueError(f"--num-frames is for video models; this model makes images (got {args.num_frames})")
    if args.duration is not None and not has_audio:
        raise ValueError(f"--duration is for audio models; this model makes no audio (got {args.duration})")
    height, width, frames = VIDEO_SIZE if is_video else (*IMAGE_SIZE, 1)
    # Every step but the last is stochastic (Flow-GRPO); one step: the whole (single-step) window.
    window = WindowPolicy("all_but_last") if args.steps >= 2 else WindowPolicy("random_start", size=1)
    return SamplingConfig(
        num_inference_steps=args.steps,
        height=args.height or height,
        width=args.width or width,
        num_frames=args.num_frames or frames,
        duration=args.duration,
        guidance_scale=args.guidance_scale,
        negative_prompt=args.negative_prompt,
        noise_level=args.noise_level,
        sde_type=args.sde_type,
        window=window,
        max_sequence_length=args.max_sequence_length,
        batch_size=args.batch,
    )


def model_folder(path: str) -> str:
    """MODEL as a folder: `reference:<name>` and `tiny:<arch>` resolve as a config's model.path does; a folder must
    exist. ValueError otherwise."""
    if path.startswith(("reference:", "tiny:")):
        from diffrl.flows.build import resolve_model_path  # the engines' imports: only for these names

        try:
            return resolve_model_path(path)
        except ValueError as e:
            raise ValueError(f"MODEL {str(e).removeprefix('model.path ')}") from None
    if not os.path.isdir(path):
        raise ValueError(
            f"MODEL {path!r} is not a directory (expected a diffusers pipeline folder, reference:<name> or tiny:<arch>)"
        )
    return path


def _input_images(args: argparse.Namespace, adapter_cls: type) -> list[dict] | None:
    """Each sample's metadata naming --image (and --last-image) as absolute paths, None for a text-only model."""
    if (args.image is not None) != adapter_cls.input_image:
        raise ValueError(
            f"--image: {adapter_cls.arch} takes an input image (an edit's input, a video's first frame), give one"
            if adapter_cls.input_image
            else f"--image: {adapter_cls.arch} takes no input image"
        )
    if args.last_image is not None and not adapter_cls.last_image:
        raise ValueError(f"--last-image: {adapter_cls.arch} takes no last frame (wan_i2v does)")
    if args.image is None:
        return None
    images = {"image": os.path.abspath(args.image)}
    if args.last_image is not None:
        images["last_image"] = os.path.abspath(args.last_image)
    return [images] * args.batch


def run(args: argparse.Namespace) -> int:
    """Loads the model, samples args.batch images/videos/audio clips and writes them; returns the exit code."""
    try:
        from diffrl.engines.rollout import RolloutEngine
        from diffrl.models.base import adapter_class, detect_architecture

        args.model = model_folder(args.model)
        out_dir = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(out_dir):
            raise ValueError(f"--out: directory {out_dir!r} does not exist")
        adapter_cls = adapter_class(detect_architecture(args.model))
        # checks the settings before the (slow) model load
        cfg = _config(args, adapter_cls.is_video, adapter_cls.has_audio)
        metadata = _input_images(args, adapter_cls)
        device, dtype = _device_and_dtype(args)
        adapter = adapter_cls.from_pretrained(args.model, device=device, dtype=dtype)
        seeds = [args.seed + i for i in range(args.batch)]
        traj = RolloutEngine(adapter).generate(
            [args.prompt] * args.batch, ["sample"] * args.batch, list(range(args.batch)), seeds, cfg, metadata=metadata
        )
    except ValueError as e:
        print(f"diffrl sample: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for i, stem in enumerate(output_stems(args.out, args.batch)):
        paths = []
        if adapter.visual and adapter.is_video:
            paths += write_video(traj.images[i].numpy(), stem, round(adapter.fps))
        elif adapter.visual:
            paths += write_image(traj.images[i].numpy(), stem, args.out, args.batch)
        if traj.audio is not None:
            paths += write_audio(traj.audio[i].numpy(), stem, args.out, args.batch, traj.sample_rate)
        for path in paths:
            print(path)
    return EXIT_OK
