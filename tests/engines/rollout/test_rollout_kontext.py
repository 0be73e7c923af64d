"""The rollout engine on the tiny FLUX.1-Kontext: parity with diffusers' FluxKontextPipeline at noise level 0 with each
sample's input image from its metadata, replay = rollout log-prob, and batch independence across input images of
different sizes (token grids)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.configs.rollout import SamplingConfig
from diffrl.engines.rollout import RolloutEngine
from diffrl.models.base import detect_architecture
from diffrl.models.flux.adapter_kontext import FluxKontextAdapter
from diffrl.shapes.edits import shapes_edit_prompts

STEPS = 4
AREA = 64 * 64  # input images resized to this area (upstream: ~1024 x 1024), to keep the CPU tests fast


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    path = tiny_model("flux_kontext")
    adapter = FluxKontextAdapter.from_pretrained(path, condition_area=AREA)
    folder = tmp_path_factory.mktemp("scenes")
    records = shapes_edit_prompts(2, seed=5, image_dir=str(folder)).records
    wide = str(folder / "wide.png")  # a second grid: 48x80 pixels -> 3x5 tokens
    Image.open(records[1].metadata["image"]).convert("RGB").resize((80, 48)).save(wide)
    return path, adapter, [r.prompt for r in records], [{"image": records[0].metadata["image"]}, {"image": wide}]


def config(**overrides) -> SamplingConfig:
    base = dict(num_inference_steps=STEPS, height=64, width=64, guidance_scale=2.5, noise_level=0.7, batch_size=2)
    return SamplingConfig(**{**base, **overrides})


def test_noise_level_0_equals_upstream_pipeline(setup):
    from diffusers import FluxKontextPipeline

    path, adapter, prompts, metadata = setup
    assert detect_architecture(path) == "flux_kontext" and adapter.input_image and not adapter.needs_negative(2.5)
    traj = RolloutEngine(adapter, progress=False).generate(
        prompts[:1], ["g"], [0], [7], config(noise_level=0.0), metadata=metadata[:1]
    )
    pipe = FluxKontextPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        image=Image.open(metadata[0]["image"]).convert("RGB"),
        prompt=prompts[0],
        guidance_scale=2.5,
        num_inference_steps=STEPS,
        height=64,
        width=64,
        max_area=64 * 64,  # upstream rescales the output size to max_area (default 1024 x 1024)
        _auto_resize=False,  # and the input image to its preferred ~1 MP resolutions
        generator=torch.Generator().manual_seed(7),
        output_type="np",
    ).images[0]
    expected = (expected * 255).round().astype("uint8")
    assert np.abs(traj.images[0].numpy().astype(int) - expected.astype(int)).max() <= 1
    assert expected.std() > 5


def test_replay_equals_rollout_and_batches_mixing_grids_equal_single_runs(setup):
    _, adapter, prompts, metadata = setup
    engine = RolloutEngine(adapter, progress=False)
    cfg = config()
    both = engine.generate(prompts, ["g0", "g1"], [0, 1], [3, 4], cfg, metadata=metadata)
    grids = engine.encode(prompts, cfg, metadata)[0]["image_grid"].tolist()
    assert grids == [[4, 4], [3, 5]]
    for j in range(both.window_size):
        replayed = engine.replay(both, j, cfg)
        torch.testing.assert_close(replayed.log_prob.detach(), both.log_probs[:, j], rtol=0, atol=1e-6)
    single = dataclasses.replace(cfg, batch_size=1)
    one = engine.generate(prompts[:1], ["g0"], [0], [3], single, metadata=metadata[:1])
    two = engine.generate(prompts[1:], ["g1"], [1], [4], single, metadata=metadata[1:])
    torch.testing.assert_close(both.latents, torch.cat([one.latents, two.latents]), rtol=0, atol=1e-4)
    assert (both.latents[0] - both.latents[1]).abs().max() > 1e-3


def test_missing_input_image_is_a_clear_error(setup):
    _, adapter, prompts, _ = setup
    with pytest.raises(ValueError, match="flux_kontext edits an input image: give one image per prompt"):
        adapter.encode_prompt(prompts[:1])
