"""Wan2.2 A14B image-to-video adapter on the tiny "wan_i2v" pipeline (two experts, no image encoder): the rollout
engine at noise level 0 equals diffusers' WanImageToVideoPipeline for a first frame (I2V) and a first and last frame
(FLF2V), replay equals the rollout's log-probs, the condition is keyed by the images and the sample shape.

diffusers 0.42.1's `pipeline_wan_i2v.basic_clean` calls ftfy without its `is_ftfy_available()` guard (ftfy is not
installed here): the tests give that module the text-to-video pipeline's `prompt_clean`, which our adapter uses and
which is the same function when ftfy is absent."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline
from PIL import Image

from diffrl.configs.rollout import SamplingConfig
from diffrl.engines.rollout import RolloutEngine
from diffrl.models.base import SampleShape
from diffrl.models.wan.adapter_i2v import WanImageToVideoAdapter

STEPS = 4  # at shift 5, sigmas 1, 0.94 | 0.83, 0.63: two steps on each expert (boundary 0.9)
GUIDANCE, GUIDANCE_LOW = 4.0, 3.0
PROMPT = "a cat running on the beach"
MAX_SEQUENCE_LENGTH = 32  # upstream's 512 zero-padded text tokens cost most of the tiny forwards


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    path = tiny_model("wan_i2v")
    folder = tmp_path_factory.mktemp("frames")
    rng = np.random.default_rng(0)
    frames = {}
    pixels = {  # not the output size: the pipeline's resize is part of the parity
        "first": rng.integers(0, 255, (40, 56, 3), dtype=np.uint8),
        "last": rng.integers(0, 255, (40, 56, 3), dtype=np.uint8),
        "other": np.full((40, 56, 3), 255, dtype=np.uint8),
    }
    for name, array in pixels.items():
        frames[name] = str(folder / f"{name}.png")
        Image.fromarray(array).save(frames[name])
    adapter = WanImageToVideoAdapter.from_pretrained(path, guidance_scale_2=GUIDANCE_LOW)
    return path, adapter, frames


def config(**overrides) -> SamplingConfig:
    base = dict(num_inference_steps=STEPS, height=32, width=32, num_frames=5, guidance_scale=GUIDANCE)
    base["max_sequence_length"] = MAX_SEQUENCE_LENGTH
    return SamplingConfig(**{**base, "negative_prompt": "blurry", "noise_level": 0.7, "batch_size": 2, **overrides})


def pipeline_uint8(path, frames, *, last: bool, monkeypatch) -> np.ndarray:
    import diffusers.pipelines.wan.pipeline_wan as t2v
    import diffusers.pipelines.wan.pipeline_wan_i2v as i2v

    monkeypatch.setattr(i2v, "prompt_clean", t2v.prompt_clean)  # see the module docstring
    pipe = WanImageToVideoPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    extra = {"last_image": Image.open(frames["last"]).convert("RGB")} if last else {}
    video = pipe(
        image=Image.open(frames["first"]).convert("RGB"),
        prompt=PROMPT,
        negative_prompt="blurry",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        guidance_scale_2=GUIDANCE_LOW,
        generator=torch.Generator().manual_seed(7),
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        output_type="np",
        **extra,
    ).frames[0]
    return (video * 255).round().astype("uint8")


@pytest.mark.parametrize("last", [False, True], ids=["i2v", "flf2v"])
def test_noise_level_0_equals_upstream_pipeline(setup, last, monkeypatch):
    path, adapter, frames = setup
    metadata = {"image": frames["first"], **({"last_image": frames["last"]} if last else {})}
    engine = RolloutEngine(adapter, progress=False)
    traj = engine.generate([PROMPT], ["g"], [0], [7], config(noise_level=0.0), metadata=[metadata])
    expected = pipeline_uint8(path, frames, last=last, monkeypatch=monkeypatch)
    assert traj.images.shape == (1, 5, 32, 32, 3) and expected.std() > 5
    assert np.abs(traj.images[0].numpy().astype(int) - expected.astype(int)).max() <= 1


def test_replay_equals_rollout_and_the_condition_follows_images_and_shape(setup):
    _, adapter, frames = setup
    engine = RolloutEngine(adapter, progress=False)
    cfg = config(height=16, width=16, guidance_scale=1.0)  # no CFG: half the forwards
    metadata = [{"image": frames["first"]}, {"image": frames["first"], "last_image": frames["last"]}]
    traj = engine.generate([PROMPT] * 2, ["g0", "g1"], [0, 1], [3, 4], cfg, metadata=metadata)
    for j in range(traj.window_size):
        replayed = engine.replay(traj, j, cfg)
        torch.testing.assert_close(replayed.log_prob.detach(), traj.log_probs[:, j], rtol=0, atol=1e-6)
    keys = traj.embed_keys
    assert keys[0] != keys[1]  # the last frame is part of the encoding's key
    # The first frame steers the velocity (so the parity above does test the condition).
    white, _, _ = engine.encode([PROMPT], cfg, [{"image": frames["other"]}])
    first = engine.encode([PROMPT], cfg, metadata[:1])[0]
    shape = SampleShape(16, 16, 5)
    v_first, v_white = (
        adapter.velocity(traj.latents[:1, 0], torch.ones(1), e, None, guidance_scale=1.0, shape=shape)
        for e in (first, white)
    )
    assert (v_first - v_white).abs().mean() > 0.2 * v_first.abs().mean()
    other_size = engine.encode([PROMPT], dataclasses.replace(cfg, height=32, width=32), metadata[:1])
    assert other_size[2][0] != keys[0] and other_size[0]["condition"].shape[-1] == 4  # 32 / VAE factor 8
    with pytest.raises(ValueError, match="condition has latent size"):
        adapter.velocity(traj.latents[:1, 0], torch.ones(1), other_size[0], None, guidance_scale=1.0, shape=shape)
    with pytest.raises(ValueError, match="sample 0 has no metadata\\['image'\\]"):
        engine.encode([PROMPT], cfg, [{"last_image": frames["last"]}])


def test_clear_errors(setup, tiny_model):
    path, adapter, frames = setup
    with pytest.raises(ValueError, match="one image per prompt"):
        adapter.encode_prompt([PROMPT], shape=SampleShape(16, 16, 5))
    with pytest.raises(ValueError, match="pass shape="):
        adapter.encode_prompt([PROMPT], images=[frames["first"]])
    with pytest.raises(ValueError, match="num_frames=3"):
        adapter.encode_prompt([PROMPT], images=[frames["first"]], shape=SampleShape(16, 16, 3))
    with pytest.raises(ValueError, match="guidance_scale_2"):
        WanImageToVideoAdapter.from_pretrained(path, unknown=1)
