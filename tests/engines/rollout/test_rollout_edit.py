"""The rollout engine on the tiny Qwen-Image-Edit: the rollout-engine contract of test_rollout_engine.py (parity with
the upstream pipeline at noise level 0, replay = rollout log-prob, stochasticity only inside the window, batch
independence) with each sample's input image from its metadata, and an embedding key of prompt + image content."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.algorithms.windows import WindowPolicy
from diffrl.configs.rollout import SamplingConfig
from diffrl.engines.rollout import RolloutEngine
from diffrl.models.base import SampleShape
from diffrl.models.qwen_image.adapter_edit import QwenImageEditAdapter, load_processor
from diffrl.shapes.edits import shapes_edit_prompts

STEPS = 4
AREA = 128 * 128  # input images resized to this area (upstream: 1024 x 1024), to keep the CPU tests fast
SHAPE = SampleShape(64, 64)


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    path = tiny_model("qwen_image_edit")
    adapter = QwenImageEditAdapter.from_pretrained(path, condition_area=AREA)
    records = shapes_edit_prompts(2, seed=5, image_dir=str(tmp_path_factory.mktemp("scenes"))).records
    return path, adapter, [r.prompt for r in records], [{"image": r.metadata["image"]} for r in records]


def config(**overrides) -> SamplingConfig:
    base = dict(num_inference_steps=STEPS, height=64, width=64, guidance_scale=4.0, negative_prompt=" ")
    return SamplingConfig(**{**base, "noise_level": 0.7, "batch_size": 2, **overrides})


def test_noise_level_0_equals_upstream_pipeline(setup, monkeypatch):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as upstream
    from diffusers import QwenImageEditPipeline

    path, adapter, prompts, metadata = setup
    traj = RolloutEngine(adapter, progress=False).generate(
        prompts[:1], ["g"], [0], [7], config(noise_level=0.0), metadata=metadata[:1]
    )
    sized = upstream.calculate_dimensions
    monkeypatch.setattr(upstream, "calculate_dimensions", lambda area, ratio: sized(AREA, ratio))
    pipe = QwenImageEditPipeline.from_pretrained(path, processor=load_processor(path))
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        image=Image.open(metadata[0]["image"]).convert("RGB"),
        prompt=prompts[0],
        negative_prompt=" ",
        true_cfg_scale=4.0,
        num_inference_steps=STEPS,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(7),
        output_type="np",
    ).images[0]
    expected = (expected * 255).round().astype("uint8")
    assert np.abs(traj.images[0].numpy().astype(int) - expected.astype(int)).max() <= 1


@pytest.fixture(scope="module")
def rollout(setup):
    _, adapter, prompts, metadata = setup
    engine = RolloutEngine(adapter, progress=False)
    cfg = config()
    return engine, cfg, engine.generate(prompts, ["g0", "g1"], [0, 1], [3, 4], cfg, metadata=metadata)


def test_replay_log_prob_equals_rollout_log_prob(rollout):
    engine, cfg, traj = rollout
    assert (traj.log_probs != 0).all() and traj.metadata[0]["image"].endswith(".png")
    for j in range(traj.window_size):
        replayed = engine.replay(traj, j, cfg)
        assert replayed.log_prob.requires_grad
        torch.testing.assert_close(replayed.log_prob.detach(), traj.log_probs[:, j], rtol=0, atol=1e-6)


def test_sample_does_not_depend_on_batch_composition(setup, rollout):
    engine, cfg, both = rollout
    _, _, prompts, metadata = setup
    single = dataclasses.replace(cfg, batch_size=1)
    one = engine.generate(prompts[:1], ["g0"], [0], [3], single, metadata=metadata[:1])
    two = engine.generate(prompts[1:], ["g1"], [1], [4], single, metadata=metadata[1:])
    torch.testing.assert_close(both.latents, torch.cat([one.latents, two.latents]), rtol=0, atol=1e-4)
    torch.testing.assert_close(both.log_probs, torch.cat([one.log_probs, two.log_probs]), rtol=0, atol=1e-4)


def test_only_window_steps_are_stochastic(setup):
    _, adapter, prompts, metadata = setup
    engine = RolloutEngine(adapter, progress=False)
    window = WindowPolicy("random_start", size=2, start_range=(1, 2))
    cfg = config(same_noise_per_group=True, window=window, guidance_scale=1.0)  # no CFG: half the forwards
    traj = engine.generate(prompts[:1] * 2, ["g", "g"], [0, 1], [21, 22], cfg, metadata=metadata[:1] * 2)
    assert traj.window_starts.tolist() == [1, 1]
    assert torch.equal(traj.latents[0, 0], traj.latents[1, 0])  # the ODE step before the window is shared
    assert (traj.latents[0, 1:] - traj.latents[1, 1:]).abs().max() > 1e-3


def test_embedding_key_is_prompt_and_image_content(setup, tmp_path):
    _, adapter, prompts, metadata = setup
    engine = RolloutEngine(adapter, progress=False)
    cfg = config(num_inference_steps=2, guidance_scale=1.0)
    copy = str(tmp_path / "copy.png")
    shutil.copy(metadata[0]["image"], copy)
    keys = [engine.encode(prompts[:1], cfg, [m])[2][0] for m in (metadata[0], {"image": copy}, metadata[1])]
    assert keys[0] == keys[1] != keys[2]  # the same bytes under another path: the same encoding
    assert keys[0] != engine.embed_key(prompts[0], cfg)  # not the text-only key
    traj = engine.generate(prompts[:1], ["g"], [0], [1], cfg, metadata=[{"image": copy}])
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(copy)  # the input changed on disk after sampling
    with pytest.raises(ValueError, match="embed_keys do not match"):
        engine.replay(traj, 0, cfg)
    with pytest.raises(ValueError, match="sample 0 has no metadata\\['image'\\]"):
        engine.encode(prompts[:1], cfg, [{}])
