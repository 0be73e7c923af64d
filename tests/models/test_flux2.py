"""FLUX.2 adapter on the tiny FLUX.2-klein pipeline: parity with diffusers' Flux2KleinPipeline at noise level 0 with
and without CFG, batch independence, and LoRA gradients on the default targets. (Upstream parity of the rollout
engine itself is tests/engines/rollout/test_rollout_engine.py's, which runs on this model too.)"""

from __future__ import annotations

import dataclasses
import functools

import parity
import pytest
import torch
from diffusers import Flux2KleinPipeline
from peft import LoraConfig, inject_adapter_in_model

from diffrl.models.base import SampleShape, load_adapter
from diffrl.models.flux2.adapter import Flux2Adapter

SHAPE = SampleShape(64, 64)
GUIDANCE = 4.0


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("flux2")


@pytest.fixture(scope="module")
def adapter(path):
    return load_adapter(path)


@pytest.fixture(scope="module")
def pipe(path):
    pipe = Flux2KleinPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


euler_sample = functools.partial(parity.euler_sample, shape=SHAPE, steps=3)


def pipeline_uint8(pipe, prompt, seed, *, guidance_scale, shape=SHAPE):
    return parity.pipeline_uint8(pipe, prompt, seed, shape=shape, steps=3, guidance_scale=guidance_scale)


def test_batch_with_cfg_equals_single_pipeline_runs(adapter, pipe):
    assert isinstance(adapter, Flux2Adapter) and adapter.needs_negative(GUIDANCE) and not adapter.needs_negative(1.0)
    prompts, seeds = ["a red bicycle", "an astronaut riding a horse on the moon"], [7, 11]
    ours = euler_sample(adapter, prompts, seeds, guidance_scale=GUIDANCE)
    for i in range(2):
        ref = pipeline_uint8(pipe, prompts[i], seeds[i], guidance_scale=GUIDANCE)[0]
        assert (ours[i].int() - ref.int()).abs().max() <= 1
    assert ref.float().std() > 5  # a real image, not a constant


def test_no_cfg_at_guidance_1_and_another_shape_match_pipeline(adapter, pipe):
    shape = SampleShape(32, 48)
    ours = euler_sample(adapter, ["a bowl of fruit"], [3], guidance_scale=1.0, shape=shape)
    ref = pipeline_uint8(pipe, "a bowl of fruit", 3, guidance_scale=1.0, shape=shape)
    assert ours.shape == (1, 32, 48, 3)
    assert (ours.int() - ref.int()).abs().max() <= 1
    guided = euler_sample(adapter, ["a bowl of fruit"], [3], guidance_scale=GUIDANCE, shape=shape)
    assert (guided.int() - ours.int()).abs().max() > 1  # CFG changes the image


def test_bad_size_is_a_clear_error(adapter):
    with pytest.raises(ValueError, match="height=40 must be a positive multiple of 16"):
        adapter.prepare_latents(SampleShape(40, 64), [torch.Generator().manual_seed(0)])


def test_lora_on_default_targets_gets_gradients(path):
    adapter = load_adapter(path)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=list(Flux2Adapter.default_lora_targets))
    inject_adapter_in_model(dataclasses.replace(config, init_lora_weights=False), adapter.transformer)
    names = [n for n, p in adapter.transformer.named_parameters() if "lora_" in n]
    # every projection kind of both block types is wrapped
    for target in ("attn.to_q", "attn.to_out.0", "ff_context.linear_out", "single_transformer_blocks.0.attn.to_qkv"):
        assert any(target in n for n in names), target
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(0)])
    enc = adapter.encode_prompt(["a cat"])
    v = adapter.velocity(x, torch.tensor([0.8]), enc, None, guidance_scale=1.0, shape=SHAPE)
    v.square().mean().backward()
    grads = [p.grad for n, p in adapter.transformer.named_parameters() if "lora_" in n]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
