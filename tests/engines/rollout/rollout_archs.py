"""The architectures the rollout tests run on, with the upstream pipeline call each must match."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@dataclass(frozen=True)
class ArchCase:
    """How to sample one arch in tests: the engine's settings and the same call to the pipeline."""

    arch: str
    adapter_file: str  # diffrl/models/<arch folder>/<file>.py
    tiny_file: str  # diffrl/models/<arch folder>/<file>.py
    guidance_scale: float
    negative_prompt: str = ""
    pipeline_kwargs: dict = field(default_factory=dict)  # guidance knob etc. for the pipeline call
    height: int = 64
    width: int = 64
    num_frames: int = 1
    # the pipeline's processor built from the folder where diffusers cannot load it here (no torchvision)
    processor_from: str = ""  # "module:function" taking the folder


CASES = [
    ArchCase(
        "sd3", "sd3/adapter.py", "sd3/tiny.py", 4.5, pipeline_kwargs={"guidance_scale": 4.5, "negative_prompt": ""}
    ),
    ArchCase(
        "qwen_image",
        "qwen_image/adapter.py",
        "qwen_image/tiny.py",
        4.0,
        negative_prompt=" ",
        pipeline_kwargs={"true_cfg_scale": 4.0, "negative_prompt": " "},
    ),
    ArchCase(
        "qwen_image21",
        "qwen_image21/adapter.py",
        "qwen_image21/tiny.py",
        4.0,
        negative_prompt=" ",
        pipeline_kwargs={"true_cfg_scale": 4.0, "negative_prompt": " "},
        processor_from="diffrl.models.qwen_image21.adapter:load_processor",
    ),
    ArchCase("flux", "flux/adapter.py", "flux/tiny.py", 3.5, pipeline_kwargs={"guidance_scale": 3.5}),
    ArchCase("flux2", "flux2/adapter.py", "flux2/tiny.py", 4.0, pipeline_kwargs={"guidance_scale": 4.0}),
    ArchCase("z_image", "z_image/adapter.py", "z_image/tiny.py", 4.0, pipeline_kwargs={"guidance_scale": 4.0}),
    ArchCase(
        "wan",
        "wan/adapter.py",
        "wan/tiny.py",
        5.0,
        pipeline_kwargs={"guidance_scale": 5.0},
        height=32,
        width=32,
        num_frames=5,
    ),
    # the guidance scale is the tiny folder's guider's (6.0): HunyuanVideo15Pipeline takes none
    ArchCase(
        "hunyuan_video15",
        "hunyuan_video15/adapter.py",
        "hunyuan_video15/tiny.py",
        6.0,
        height=32,
        width=32,
        num_frames=5,
    ),
]


def arch_params(archs: list[str] | None = None) -> list:
    """pytest params of the cases; an arch whose adapter or tiny builder file is absent is skipped
    with that reason (the adapters are written in parallel)."""
    params = []
    for case in CASES:
        if archs is not None and case.arch not in archs:
            continue
        missing = [
            p
            for p in (f"diffrl/models/{case.adapter_file}", f"diffrl/models/{case.tiny_file}")
            if not os.path.isfile(os.path.join(_ROOT, p))
        ]
        marks = [pytest.mark.skip(reason=f"{case.arch}: {', '.join(missing)} not in the repository")] if missing else []
        params.append(pytest.param(case, id=case.arch, marks=marks))
    return params


def pipeline_pixels(path: str, case: ArchCase, prompt: str, seed: int, steps: int) -> np.ndarray:
    """The upstream diffusers pipeline's output for one prompt, as uint8 (H, W, 3) or (F, H, W, 3)."""
    from diffusers import DiffusionPipeline

    components = {}
    if case.processor_from:
        module, name = case.processor_from.split(":")
        components["processor"] = getattr(importlib.import_module(module), name)(path)
    pipe = DiffusionPipeline.from_pretrained(path, torch_dtype=torch.float32, **components)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(case.pipeline_kwargs, height=case.height, width=case.width)
    if case.num_frames > 1:
        kwargs["num_frames"] = case.num_frames
    out = pipe(
        prompt=prompt,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
        **kwargs,
    )
    pixels = np.asarray(out.frames if case.num_frames > 1 else out.images)
    if pixels.shape[-1] == 4:  # RGBA (Qwen-Image-2.1's VAE): over white, as the adapters return RGB
        pixels = pixels[..., :3] * pixels[..., 3:] + (1 - pixels[..., 3:])
    # The rounding VaeImageProcessor.numpy_to_pil applies.
    return (pixels[0] * 255).round().astype("uint8")
