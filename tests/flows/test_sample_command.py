"""`diffrl sample` and `diffrl tiny-model` through their run(args): files written, upstream parity at
noise level 0, and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import pytest
from PIL import Image

from diffrl.flows.commands import sample, tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engines", "rollout"))
from rollout_archs import arch_params, pipeline_pixels  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="diffrl")
    subparsers = parser.add_subparsers(dest="command", required=True)
    sample.add_parser(subparsers)
    tiny_model.add_parser(subparsers)
    return parser.parse_args(argv)


@pytest.mark.parametrize("case", arch_params(["sd3", "qwen_image", "flux"]))
def test_sample_at_noise_level_0_equals_upstream(case, tiny_model, tmp_path, capsys):
    path = tiny_model(case.arch)
    out = tmp_path / "image.png"
    args = parse(
        [
            "sample",
            path,
            "--prompt",
            "a red cube",
            "--negative-prompt",
            case.negative_prompt,
            "--steps",
            "4",
            "--height",
            "64",
            "--width",
            "64",
            "--guidance-scale",
            str(case.guidance_scale),
            "--seed",
            "7",
            "--out",
            str(out),
        ]
    )
    assert sample.run(args) == 0
    assert capsys.readouterr().out.split() == [str(out)]
    got = np.asarray(Image.open(out).convert("RGB")).astype(int)
    expected = pipeline_pixels(path, case, "a red cube", seed=7, steps=4).astype(int)
    assert got.shape == expected.shape and np.abs(got - expected).max() <= 1


@pytest.mark.parametrize("case", arch_params(["sd3"]))
def test_sample_batch_writes_one_png_per_seed(case, tiny_model, tmp_path, capsys):
    path = tiny_model(case.arch)
    args = parse(
        [
            "sample",
            path,
            "--prompt",
            "a cat",
            "--steps",
            "2",
            "--height",
            "64",
            "--width",
            "64",
            "--noise-level",
            "0.5",
            "--seed",
            "3",
            "--batch",
            "2",
            "--out",
            str(tmp_path / "cats.png"),
        ]
    )
    assert sample.run(args) == 0
    written = capsys.readouterr().out.split()
    assert written == [str(tmp_path / "cats_0.png"), str(tmp_path / "cats_1.png")]
    first, second = (np.asarray(Image.open(p)) for p in written)
    assert first.shape == (64, 64, 3) and not np.array_equal(first, second)


@pytest.mark.parametrize("case", arch_params(["wan"]))
def test_sample_video_writes_gif_and_frames(case, tiny_model, tmp_path, capsys):
    path = tiny_model(case.arch)
    args = parse(
        [
            "sample",
            path,
            "--prompt",
            "a wave",
            "--steps",
            "2",
            "--height",
            "32",
            "--width",
            "32",
            "--num-frames",
            "5",
            "--out",
            str(tmp_path / "wave.gif"),
        ]
    )
    assert sample.run(args) == 0
    assert str(tmp_path / "wave.gif") in capsys.readouterr().out.split()
    with Image.open(tmp_path / "wave.gif") as gif:
        assert gif.n_frames == 5 and gif.size == (32, 32)
    assert sorted(os.listdir(tmp_path / "wave_frames")) == [f"{k:04d}.png" for k in range(5)]


def test_sample_image_to_video_takes_a_first_and_a_last_frame(tiny_model, tmp_path):
    path = tiny_model("wan_i2v")
    rng = np.random.default_rng(0)
    for name in ("first", "last"):
        Image.fromarray(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(tmp_path / f"{name}.png")
    size = ["--steps", "2", "--height", "16", "--width", "16", "--num-frames", "5", "--guidance-scale", "1"]
    base = ["sample", path, "--prompt", "a wave", *size, "--image", str(tmp_path / "first.png")]
    frames = {}
    for name, extra in (("i2v", []), ("flf2v", ["--last-image", str(tmp_path / "last.png")])):
        assert sample.run(parse([*base, *extra, "--out", str(tmp_path / f"{name}.gif")])) == 0
        frames[name] = [np.asarray(Image.open(tmp_path / f"{name}_frames" / f"{k:04d}.png")) for k in range(5)]
    assert frames["i2v"][-1].shape == (16, 16, 3)
    assert not np.array_equal(frames["i2v"][-1], frames["flf2v"][-1])  # the last frame steers the video


@pytest.mark.parametrize("case", arch_params(["sd3"]))
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--height", "60"], "height"),
        (["--last-image", "x.png"], "--last-image: sd3 takes no last frame"),
        (["--noise-level", "-1"], "noise_level"),
        (["--sde-type", "ddim"], "sde_type"),
        (["--steps", "0"], "steps"),
    ],
)
def test_sample_bad_input_is_one_line_exit_2(case, flags, message, tiny_model, tmp_path, capsys):
    args = parse(["sample", tiny_model(case.arch), "--prompt", "x", "--out", str(tmp_path / "x.png"), *flags])
    assert sample.run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # earlier lines: model-loading progress
    assert err.startswith("diffrl sample: error:") and message in err
    assert not (tmp_path / "x.png").exists()


def test_sample_missing_or_unsupported_model_folder(tmp_path, capsys):
    assert sample.run(parse(["sample", str(tmp_path / "nope"), "--prompt", "x", "--out", "x.png"])) == 2
    assert "not a directory" in capsys.readouterr().err
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    assert sample.run(parse(["sample", str(tmp_path), "--prompt", "x", "--out", str(tmp_path / "x.png")])) == 2
    err = capsys.readouterr().err
    assert "KandinskyPipeline" in err and "supported" in err


@pytest.mark.parametrize("case", arch_params(["sd3"]))
def test_tiny_model_command_is_deterministic_and_loadable(case, tmp_path, capsys):
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    for name in ("a", "b"):
        assert tiny_model.run(parse(["tiny-model", "sd3", str(tmp_path / name), "--seed", "3"])) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "a"), str(tmp_path / "b")]
    pipe = DiffusionPipeline.from_pretrained(str(tmp_path / "a"))
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    weights = "transformer/diffusion_pytorch_model.safetensors"
    a, b = load_file(str(tmp_path / "a" / weights)), load_file(str(tmp_path / "b" / weights))
    assert all((a[k] == b[k]).all() for k in a)


def test_tiny_model_unknown_arch_is_exit_2(tmp_path, capsys):
    assert tiny_model.run(parse(["tiny-model", "stable-cascade", str(tmp_path / "x")])) == 2
    err = capsys.readouterr().err.strip()
    assert "stable-cascade" in err and "sd3" in err and "\n" not in err
    assert not (tmp_path / "x").exists()


def test_sample_takes_the_model_names_configs_take(tmp_path, capsys):
    """`reference:<name>` and `tiny:<arch>` are model.path values in configs; MODEL takes them too."""
    out = tmp_path / "shapes.png"
    argv = ["sample", "reference:shapes-small", "--prompt", "two red circles", "--steps", "2", "--out", str(out)]
    assert sample.run(parse([*argv, "--height", "64", "--width", "64"])) == 0
    assert capsys.readouterr().out.split() == [str(out)]
    assert Image.open(out).size == (64, 64)
    assert sample.run(parse(["sample", "reference:nope", "--prompt", "x", "--out", str(out)])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diffrl sample: error: MODEL 'reference:nope'") and "'shapes-small'" in err
    assert sample.run(parse(["sample", "tiny:nope", "--prompt", "x", "--out", str(out)])) == 2
    assert "'tiny:sd3'" in capsys.readouterr().err


def test_sample_audio_writes_the_pipelines_waveform_as_wav(tiny_model, tmp_path, capsys):
    import torch
    from diffusers import StableAudio3Pipeline

    from diffrl.models.wav import decode_wav

    path = tiny_model("stable_audio3")
    argv = ["sample", path, "--prompt", "soft rain", "--steps", "3", "--duration", "0.25", "--seed", "5"]
    assert sample.run(parse([*argv, "--batch", "2", "--out", str(tmp_path / "rain.wav")])) == 0
    written = capsys.readouterr().out.split()
    assert written == [str(tmp_path / "rain_0.wav"), str(tmp_path / "rain_1.wav")]
    pipe = StableAudio3Pipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    for i, file in enumerate(written):  # sample i is the pipeline run with seed 5 + i, as 16-bit PCM
        expected = pipe(
            "soft rain", duration=0.25, num_inference_steps=3, generator=torch.Generator().manual_seed(5 + i)
        )
        with open(file, "rb") as f:
            waveform, rate = decode_wav(f.read())
        assert rate == 8000 and waveform.shape == (2, 2000)
        np.testing.assert_allclose(waveform, expected.audios[0].numpy(), rtol=0, atol=1e-4)
    assert sample.run(parse(["sample", tiny_model("sd3"), "--prompt", "x", "--duration", "1", "--out", "x.png"])) == 2
    assert "--duration is for audio models" in capsys.readouterr().err
