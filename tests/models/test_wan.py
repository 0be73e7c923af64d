"""Wan adapter on the tiny Wan2.1 ("wan") and two-expert Wan2.2 ("wan22") pipelines: parity with
diffusers' WanPipeline at noise level 0, prompt encoding, sigmas, shapes, expert routing, gradients."""

from __future__ import annotations

import functools

import numpy as np
import parity
import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanPipeline
from peft import LoraConfig

from diffrl.models.base import SampleShape, load_adapter
from diffrl.models.wan.adapter import WanAdapter

SHAPE = SampleShape(64, 64, num_frames=5)
SMALL = SampleShape(32, 32, num_frames=5)  # for the extra parity checks: the 2-core CI budget is tight
GUIDANCE = 5.0  # WanPipeline's default CFG
# Wan2.2 A14B's (high-noise, low-noise) guidance pair.
GUIDANCE_22, GUIDANCE_22_LOW = 4.0, 3.0


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("wan")


@pytest.fixture(scope="module")
def path22(tiny_model):
    return tiny_model("wan22")


@pytest.fixture(scope="module")
def adapter(path):
    return WanAdapter.from_pretrained(path)


@pytest.fixture(scope="module")
def adapter22(path22):
    return WanAdapter.from_pretrained(path22, guidance_scale_2=GUIDANCE_22_LOW)


def _pipe(path: str) -> WanPipeline:
    pipe = WanPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe(path):
    return _pipe(path)


@pytest.fixture(scope="module")
def pipe22(path22):
    return _pipe(path22)


# this architecture's defaults for the shared noise-level-0 loop
euler_sample = functools.partial(parity.euler_sample, guidance_scale=GUIDANCE, shape=SHAPE)


def pipeline_uint8(pipe, prompt, seed, *, steps=4, guidance_scale=GUIDANCE, shape=SHAPE, negative="", **kwargs):
    out = pipe(
        prompt=prompt,
        negative_prompt=negative,
        height=shape.height,
        width=shape.width,
        num_frames=shape.num_frames,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
        **kwargs,
    ).frames
    return torch.from_numpy((out * 255).round().astype("uint8"))


def pipeline_cfg(model, x, timestep, prompt_embeds, negative_embeds, guidance_scale):
    """WanPipeline's loop body: two forwards (cond, uncond) and `uncond + g * (cond - uncond)`."""
    cond = model(hidden_states=x, timestep=timestep, encoder_hidden_states=prompt_embeds, return_dict=False)[0]
    uncond = model(hidden_states=x, timestep=timestep, encoder_hidden_states=negative_embeds, return_dict=False)[0]
    return uncond + guidance_scale * (cond - uncond)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.int() - b.int()).abs().max())


def test_noise_level_0_matches_pipeline(adapter, pipe):
    ours = euler_sample(adapter, ["a photo of a cat"], [7])
    ref = pipeline_uint8(pipe, "a photo of a cat", 7)
    assert ours.shape == (1, 5, 64, 64, 3) and ours.dtype == torch.uint8
    assert max_diff(ours, ref) <= 1
    assert ref.float().std() > 5  # a real video, not a constant
    # Guidance visibly changes the tiny model's output, so the parity above does test CFG.
    assert (pipeline_uint8(pipe, "a photo of a cat", 7, guidance_scale=1.0).float() - ref.float()).abs().mean() > 2


def test_batch_of_two_equals_single_runs(adapter, pipe):
    prompts, seeds = ["a red bicycle", "an astronaut riding a horse on the moon"], [7, 11]
    ours = euler_sample(adapter, prompts, seeds, negative="blurry, low quality", shape=SMALL)
    for i in range(2):
        ref = pipeline_uint8(pipe, prompts[i], seeds[i], negative="blurry, low quality", shape=SMALL)[0]
        assert max_diff(ours[i], ref) <= 1


def test_no_guidance_and_other_size_match_pipeline(adapter, pipe):
    shape = SampleShape(32, 48, num_frames=1)
    ours = euler_sample(adapter, ["a bowl of fruit"], [3], guidance_scale=1.0, shape=shape)
    assert not adapter.needs_negative(1.0) and ours.shape == (1, 1, 32, 48, 3)
    assert max_diff(ours, pipeline_uint8(pipe, "a bowl of fruit", 3, guidance_scale=1.0, shape=shape)) <= 1


def test_two_expert_layout_matches_pipeline(adapter22, pipe22):
    ours = euler_sample(adapter22, ["a boat on the ocean"], [7], guidance_scale=GUIDANCE_22)
    ref = pipeline_uint8(pipe22, "a boat on the ocean", 7, guidance_scale=GUIDANCE_22, guidance_scale_2=GUIDANCE_22_LOW)
    assert max_diff(ours, ref) <= 1
    # 4 steps at shift 12 put 2 steps on each expert, so guidance_scale_2 must matter.
    sigmas = adapter22.sigmas(4, SHAPE)
    assert sigmas[1] >= 0.875 > sigmas[2]
    same_scale = pipeline_uint8(pipe22, "a boat on the ocean", 7, guidance_scale=GUIDANCE_22, shape=SMALL)
    assert (
        max_diff(
            same_scale,
            pipeline_uint8(
                pipe22,
                "a boat on the ocean",
                7,
                guidance_scale=GUIDANCE_22,
                guidance_scale_2=GUIDANCE_22_LOW,
                shape=SMALL,
            ),
        )
        > 5
    )
    # guidance_scale_2=None means "same as guidance_scale", as upstream.
    adapter22.guidance_scale_2 = None
    try:
        ours_same = euler_sample(adapter22, ["a boat on the ocean"], [7], guidance_scale=GUIDANCE_22, shape=SMALL)
        assert max_diff(ours_same, same_scale) <= 1
    finally:
        adapter22.guidance_scale_2 = GUIDANCE_22_LOW


def test_per_token_timesteps_layout_matches_pipeline(path, tmp_path):
    """Wan2.2 TI2V's `expand_timesteps=True` (one timestep per latent token) on the tiny weights."""
    parts = WanPipeline.from_pretrained(path).components
    WanPipeline(**{k: v for k, v in parts.items() if k != "transformer_2"}, expand_timesteps=True).save_pretrained(
        str(tmp_path)
    )
    adapter = WanAdapter.from_pretrained(str(tmp_path))
    assert adapter.pipe.config.expand_timesteps
    ours = euler_sample(adapter, ["a small blue bird"], [5], shape=SMALL)
    assert max_diff(ours, pipeline_uint8(_pipe(str(tmp_path)), "a small blue bird", 5, shape=SMALL)) <= 1


def test_mixed_experts_in_one_batch_equal_single_calls(adapter22):
    enc = adapter22.encode_prompt(["a cat", "a dog", "a bird"])
    neg = adapter22.encode_prompt(["", "", ""])
    x = adapter22.prepare_latents(SMALL, [torch.Generator().manual_seed(i) for i in range(3)])
    sigma = torch.tensor([0.96, 0.3, 0.9])  # high-noise, low-noise, high-noise expert
    # Tolerance 1e-4: CPU matmuls round differently per batch size, and CFG (x4) amplifies it.
    with torch.no_grad():
        both = adapter22.velocity(x, sigma, enc, neg, guidance_scale=GUIDANCE_22, shape=SMALL)
        for i in range(3):
            one = adapter22.velocity(
                x[i : i + 1],
                sigma[i : i + 1],
                {k: v[i : i + 1] for k, v in enc.items()},
                {k: v[i : i + 1] for k, v in neg.items()},
                guidance_scale=GUIDANCE_22,
                shape=SMALL,
            )
            torch.testing.assert_close(both[i : i + 1], one, rtol=1e-4, atol=1e-4)
        # Rows against WanPipeline's own loop body: row 0 -> transformer at guidance_scale, row 1 ->
        # transformer_2 at guidance_scale_2; the other expert gives something else.
        pos_e, neg_e = enc["prompt_embeds"], neg["prompt_embeds"]
        pipe = adapter22.pipe
        for row, expert, scale, other in [
            (0, pipe.transformer, GUIDANCE_22, pipe.transformer_2),
            (1, pipe.transformer_2, GUIDANCE_22_LOW, pipe.transformer),
        ]:
            rows = slice(row, row + 1)
            ref = pipeline_cfg(expert, x[rows], sigma[rows] * 1000, pos_e[rows], neg_e[rows], scale)
            torch.testing.assert_close(both[rows], ref, rtol=1e-4, atol=1e-4)
            wrong = pipeline_cfg(other, x[rows], sigma[rows] * 1000, pos_e[rows], neg_e[rows], scale)
            assert (wrong - both[rows]).abs().max() > 1e-2
    with pytest.raises(ValueError, match="negative"):
        adapter22.velocity(x, sigma, enc, None, guidance_scale=GUIDANCE_22, shape=SMALL)


def test_encode_prompt_equals_pipeline(adapter, pipe):
    prompts = ["a cat", "Two  dogs playing with a ball, 4k &amp; more"]
    # Under no_grad as in WanPipeline.__call__: with grad enabled UMT5's SDPA rounds differently (~1e-5).
    with torch.no_grad():
        pos, neg = pipe.encode_prompt(
            prompts, negative_prompt=["", "ugly"], do_classifier_free_guidance=True, max_sequence_length=512
        )
        short, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=24)
    ours, ours_neg = adapter.encode_prompt(prompts), adapter.encode_prompt(["", "ugly"])
    assert ours["prompt_embeds"].shape == (2, 512, 32) and set(ours) == {"prompt_embeds"}
    torch.testing.assert_close(ours["prompt_embeds"], pos, rtol=0, atol=0)
    torch.testing.assert_close(ours_neg["prompt_embeds"], neg, rtol=0, atol=0)
    torch.testing.assert_close(
        adapter.encode_prompt(prompts, max_sequence_length=24)["prompt_embeds"], short, rtol=0, atol=0
    )


def test_too_long_prompt_warns_and_truncates(adapter, pipe):
    long_prompt = "a photo of a cat sitting on a red chair next to a window"
    with pytest.warns(UserWarning, match=r"prompt 0 has \d+ tokens, more than max_sequence_length=8: truncated"):
        enc = adapter.encode_prompt([long_prompt], max_sequence_length=8)
    with torch.no_grad():
        ref, _ = pipe.encode_prompt([long_prompt], do_classifier_free_guidance=False, max_sequence_length=8)
    torch.testing.assert_close(enc["prompt_embeds"], ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="max_sequence_length=0"):
        adapter.encode_prompt(["a cat"], max_sequence_length=0)


@pytest.mark.parametrize("which,steps", [("wan", 4), ("wan", 10), ("wan22", 6)])
def test_sigmas_equal_pipeline_scheduler(adapter, pipe, adapter22, pipe22, which, steps):
    ad, pp = (adapter, pipe) if which == "wan" else (adapter22, pipe22)
    shape = SampleShape(32, 32, num_frames=1)
    pipeline_uint8(pp, "a cat", 0, steps=steps, guidance_scale=1.0, shape=shape)  # leaves its sigmas behind
    ours = ad.sigmas(steps, shape)
    assert ours.dtype == torch.float32 and ours.shape == (steps + 1,) and ours[-1] == 0 and ours[0] == 1
    torch.testing.assert_close(ours, pp.scheduler.sigmas, rtol=0, atol=0)
    # Closed form: FlowMatchEuler's static shift applied to linspace(1, shift(1/1000)) (shifted twice).
    shift = pp.scheduler.config.shift
    shifted = lambda s: shift * s / (1 + (shift - 1) * s)  # noqa: E731
    t = np.linspace(1.0, shifted(1e-3), steps)
    np.testing.assert_allclose(ours[:-1].numpy(), shifted(t), rtol=1e-5)


def test_sigmas_of_a_unipc_folder_are_the_unipc_schedule(adapter):
    """Real Wan folders ship UniPC: sigmas() reads that scheduler's flow sigmas (our steps are Euler/SDE)."""
    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    euler, adapter.pipe.scheduler = adapter.pipe.scheduler, unipc
    try:
        ours = adapter.sigmas(8, SHAPE)
    finally:
        adapter.pipe.scheduler = euler
    unipc.set_timesteps(8)
    assert ours.shape == (9,) and ours[-1] == 0
    torch.testing.assert_close(ours, unipc.sigmas.float(), rtol=0, atol=0)
    t = np.linspace(1.0, 1e-3, 9)[:-1]
    np.testing.assert_allclose(ours[1:-1].numpy(), (3 * t / (1 + 2 * t))[1:], rtol=1e-5)  # [0] is 1 - 1e-6


def test_prepare_latents_per_sample_generators(adapter):
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)])
    assert x.shape == (2, 4, 2, 8, 8) and x.dtype == torch.float32  # (5 - 1) // 4 + 1 = 2 latent frames
    torch.testing.assert_close(x[1:], torch.randn((1, 4, 2, 8, 8), generator=torch.Generator().manual_seed(8)))


def test_bad_shape_options_and_missing_folder(adapter, path, tmp_path):
    with pytest.raises(ValueError, match=r"num_frames=4 must be k \* 4 \+ 1"):
        adapter.check_shape(SampleShape(64, 64, num_frames=4))
    with pytest.raises(ValueError, match=r"height=40 must be a positive multiple of 16"):
        adapter.prepare_latents(SampleShape(40, 64, 5), [torch.Generator()])
    with pytest.raises(ValueError, match=r"width=24 must be a positive multiple of 16"):
        adapter.check_shape(SampleShape(64, 24, 5))
    with pytest.raises(ValueError, match="guidance_scale_2"):  # Wan2.1 has one expert
        WanAdapter.from_pretrained(path, guidance_scale_2=3.0)
    with pytest.raises(ValueError, match="nope"):
        WanAdapter.from_pretrained(str(tmp_path / "nope"))


def test_load_adapter_detects_wan_and_experts(path, path22):
    one, two = load_adapter(path), load_adapter(path22)
    assert isinstance(one, WanAdapter) and one.source == path and one.arch == "wan" and one.is_video
    assert isinstance(two, WanAdapter) and two.boundary_ratio == 0.875 and two.guidance_scale_2 is None
    assert len(one.denoisers()) == 1 and len(two.denoisers()) == 2
    assert len(two.fsdp_wrap_units()) == 4 and all(
        type(b).__name__ == "WanTransformerBlock" for b in two.fsdp_wrap_units()
    )


def test_velocity_is_differentiable_wrt_lora_of_both_experts(path22):
    adapter = WanAdapter.from_pretrained(path22)
    for model in adapter.denoisers():
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(adapter.default_lora_targets)))
        lora_modules = {n for n, _ in model.named_modules() if n.endswith("lora_B.default")}
        for target in adapter.default_lora_targets:  # every default target exists in the transformer
            assert any(n.endswith(f"{target}.lora_B.default") for n in lora_modules), target
    enc, neg = adapter.encode_prompt(["a cat", "a dog"]), adapter.encode_prompt(["", ""])
    x = adapter.prepare_latents(SMALL, [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)])
    v = adapter.velocity(x, torch.tensor([0.95, 0.2]), enc, neg, guidance_scale=GUIDANCE_22, shape=SMALL)
    v.sum().backward()
    for model in adapter.denoisers():
        grads = {n: p.grad for n, p in model.named_parameters() if "lora_B" in n}
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())
