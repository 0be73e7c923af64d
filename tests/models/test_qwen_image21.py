"""Qwen-Image-2.1 adapter on the tiny QwenImage21Pipeline: its parts against the pipeline's own (the sampled pixels at
noise level 0 are tests/engines/rollout/test_rollout_engine.py's, case qwen_image21)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from diffusers import QwenImage21Pipeline
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift, retrieve_timesteps
from peft import LoraConfig

from diffrl.models.base import SampleShape, load_adapter
from diffrl.models.qwen_image21.adapter import QwenImage21Adapter, over_white

SHAPE = SampleShape(64, 96)


@pytest.fixture(scope="module")
def adapter(tiny_model):
    return load_adapter(tiny_model("qwen_image21"))


@pytest.fixture(scope="module")
def pipe(adapter):
    """The upstream pipeline on the same modules."""
    return QwenImage21Pipeline(**adapter.pipe.components)


def test_encode_prompt_equals_pipeline(adapter, pipe):
    prompts = ["a red cube on a blue table", "a cat", ""]
    ours = adapter.encode_prompt(prompts)
    for i, prompt in enumerate(prompts):
        embeds, mask, image_pad = pipe.encode_prompt(prompt=prompt)
        n = int(ours["prompt_embeds_mask"][i].sum())
        assert mask is None and not image_pad.any() and embeds.shape[1] == n  # alone: no padding, no image
        torch.testing.assert_close(ours["prompt_embeds"][i, :n], embeds[0].detach(), rtol=0, atol=1e-5)
    assert ours["prompt_embeds_mask"][1].sum() < ours["prompt_embeds_mask"][0].sum()
    # The system message is dropped; what is left starts the user turn.
    assert pipe._drop_idx > 0
    with pytest.warns(UserWarning, match="truncated to 3 tokens"):
        cut = adapter.encode_prompt(prompts[:1], max_sequence_length=3)
    torch.testing.assert_close(cut["prompt_embeds"][0], ours["prompt_embeds"][0, :3])


def test_sigmas_and_noise_equal_pipeline(adapter, pipe):
    rows, cols = SHAPE.height // 16, SHAPE.width // 16
    config = pipe.scheduler.config
    mu = calculate_shift(
        rows * cols, config.base_image_seq_len, config.max_image_seq_len, config.base_shift, config.max_shift
    )
    retrieve_timesteps(pipe.scheduler, 5, "cpu", sigmas=np.linspace(1.0, 1 / 5, 5), mu=mu)
    torch.testing.assert_close(adapter.sigmas(5, SHAPE), pipe.scheduler.sigmas.float(), rtol=0, atol=0)
    latents, _ = pipe.prepare_latents(
        None, 1, 8, SHAPE.height, SHAPE.width, torch.float32, "cpu", torch.Generator().manual_seed(3)
    )
    ours = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)])
    assert ours.shape == (2, rows * cols, 8)
    torch.testing.assert_close(ours[:1], latents, rtol=0, atol=0)


def test_shipped_sample_sigmas_fix_the_schedule(tiny_model):
    adapter = load_adapter(tiny_model("qwen_image21"))
    adapter.pipe.register_to_config(sample_sigmas=[1.0, 0.8, 0.5])
    assert adapter.sigmas(3, SHAPE).shape == (4,)
    with pytest.raises(ValueError, match="num_inference_steps=4.*sample_sigmas, 3 steps"):
        adapter.sigmas(4, SHAPE)


def test_bad_shapes_raise(adapter):
    for shape, field in ((SampleShape(48, 64), "height=48"), (SampleShape(64, 40), "width=40")):
        with pytest.raises(ValueError, match=f"{field} must be a positive multiple of 32"):
            adapter.check_shape(shape)
    with pytest.raises(ValueError, match="num_frames=5"):
        adapter.check_shape(dataclasses.replace(SHAPE, num_frames=5))
    with pytest.raises(ValueError, match="unexpected options"):
        QwenImage21Adapter.from_pretrained("x", guidance=2)


def test_over_white_composites_alpha():
    rgba = torch.tensor([0.2, 0.4, 0.6, 0.5]).view(1, 4, 1, 1)
    torch.testing.assert_close(over_white(rgba).flatten(), torch.tensor([0.6, 0.7, 0.8]))


def test_velocity_reaches_every_lora_target(tiny_model):
    adapter = load_adapter(tiny_model("qwen_image21"))
    adapter.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(adapter.default_lora_targets)))
    enc = adapter.encode_prompt(["a cat", "a red cube on a blue table"])
    neg = adapter.encode_prompt([" ", " "])
    shape = SampleShape(64, 64)
    x = adapter.prepare_latents(shape, [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)])
    adapter.velocity(x, torch.tensor([0.7, 0.4]), enc, neg, guidance_scale=3.0, shape=shape).sum().backward()
    lora_b = {n: p for n, p in adapter.transformer.named_parameters() if "lora_B" in n}
    assert len(lora_b) == len(adapter.default_lora_targets) * len(adapter.transformer.transformer_blocks)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b.values())
