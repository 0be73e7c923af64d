"""Z-Image adapter on the tiny Z-Image pipeline: parity with diffusers' ZImagePipeline."""

from __future__ import annotations

import functools

import parity
import pytest
import torch
from diffusers import ZImagePipeline
from peft import LoraConfig

from diffrl.models.base import SampleShape, load_adapter
from diffrl.models.z_image.adapter import ZImageAdapter, z_image_cfg

SHAPE = SampleShape(64, 64)
GUIDANCE = 4.0


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("z_image")


@pytest.fixture(scope="module")
def adapter(path):
    return ZImageAdapter.from_pretrained(path)


@pytest.fixture(scope="module")
def pipe(path):
    pipe = ZImagePipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# this architecture's defaults for the shared noise-level-0 loop
euler_sample = functools.partial(parity.euler_sample, guidance_scale=GUIDANCE, shape=SHAPE)


def pipeline_uint8(pipe, prompt, seed, *, steps=4, guidance_scale=GUIDANCE, shape=SHAPE, **kwargs):
    out = pipe(
        prompt=prompt,
        num_inference_steps=steps,
        height=shape.height,
        width=shape.width,
        guidance_scale=guidance_scale,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
        **kwargs,
    ).images
    return torch.from_numpy((out * 255).round().astype("uint8"))


def test_noise_level_0_matches_pipeline(adapter, pipe):
    ours = euler_sample(adapter, ["a photo of a cat"], [7])
    ref = pipeline_uint8(pipe, "a photo of a cat", 7)
    assert ours.shape == (1, 64, 64, 3) and ours.dtype == torch.uint8
    assert (ours.int() - ref.int()).abs().max() <= 1
    assert ref.float().std() > 5  # a real image, not a constant


def test_batch_of_two_equals_single_runs(adapter, pipe):
    prompts, seeds = ["a red bicycle", "an astronaut riding a horse on the moon, digital art"], [7, 11]
    ours = euler_sample(adapter, prompts, seeds)
    for i in range(2):
        ref = pipeline_uint8(pipe, prompts[i], seeds[i])[0]
        assert (ours[i].int() - ref.int()).abs().max() <= 1


def test_negative_prompt_and_no_guidance_match_pipeline(adapter, pipe):
    shape = SampleShape(48, 80)
    ours = euler_sample(adapter, ["a bowl of fruit"], [3], negative="blurry", shape=shape, steps=3)
    ref = pipeline_uint8(pipe, "a bowl of fruit", 3, negative_prompt="blurry", shape=shape, steps=3)
    assert (ours.int() - ref.int()).abs().max() <= 1
    # guidance_scale 0 switches CFG off upstream (CFG runs for any scale > 0, not > 1).
    assert not adapter.needs_negative(0.0) and adapter.needs_negative(0.5)
    ours = euler_sample(adapter, ["a bowl of fruit"], [3], guidance_scale=0.0, shape=shape, steps=3)
    ref = pipeline_uint8(pipe, "a bowl of fruit", 3, guidance_scale=0.0, shape=shape, steps=3)
    assert (ours.int() - ref.int()).abs().max() <= 1


def test_cfg_truncation_and_normalization_match_pipeline(path, pipe):
    # Sigmas (1, .9, .75, .5): (1000 - t) / 1000 = (0, .1, .25, .5) -> truncation 0.3 drops CFG at the last
    # step; normalization 1.0 caps |pred| at |cond| on the others.
    adapter = ZImageAdapter.from_pretrained(path, cfg_normalization=1.0, cfg_truncation=0.3)
    ours = euler_sample(adapter, ["a sign that says hello world"], [5])
    ref = pipeline_uint8(pipe, "a sign that says hello world", 5, cfg_normalization=1.0, cfg_truncation=0.3)
    assert (ours.int() - ref.int()).abs().max() <= 1
    plain = pipeline_uint8(pipe, "a sign that says hello world", 5)
    assert (plain.int() - ref.int()).abs().max() > 1  # the options change the image


def test_encode_prompt_equals_pipeline(adapter, pipe):
    prompts = ["a cat", "Two dogs playing with a ball in a green park, 4k"]
    with torch.no_grad():
        ref, _ = pipe.encode_prompt(list(prompts), device="cpu", do_classifier_free_guidance=False)
    enc = adapter.encode_prompt(prompts)
    mask = enc["prompt_embeds_mask"]
    assert mask.dtype == torch.bool and enc["prompt_embeds"].shape[:2] == mask.shape
    assert mask.shape[1] == max(r.shape[0] for r in ref)
    for i in range(2):
        assert int(mask[i].sum()) == ref[i].shape[0] and bool(mask[i, : ref[i].shape[0]].all())
        torch.testing.assert_close(enc["prompt_embeds"][i][mask[i]], ref[i], rtol=0, atol=0)
        assert not enc["prompt_embeds"][i][~mask[i]].any()


def test_long_prompt_warns_and_truncates_as_upstream(adapter, pipe):
    prompt = "a watercolor of a forest path in autumn with orange leaves and a small blue bird"
    with pytest.warns(UserWarning, match=r"max_sequence_length=16: it is truncated to 16"):
        enc = adapter.encode_prompt([prompt], max_sequence_length=16)
    with torch.no_grad():
        ref, _ = pipe.encode_prompt([prompt], device="cpu", do_classifier_free_guidance=False, max_sequence_length=16)
    assert enc["prompt_embeds"].shape[1] == 16 == ref[0].shape[0]
    torch.testing.assert_close(enc["prompt_embeds"][0], ref[0], rtol=0, atol=0)


@pytest.mark.parametrize("steps,height,width", [(4, 64, 64), (3, 128, 96)])
def test_sigmas_equal_pipeline_scheduler(adapter, pipe, steps, height, width):
    pipe(
        prompt="a cat",
        num_inference_steps=steps,
        height=height,
        width=width,
        guidance_scale=0.0,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    )
    ours = adapter.sigmas(steps, SampleShape(height, width))
    assert ours.dtype == torch.float32 and ours.shape == (steps + 1,) and ours[-1] == 0
    torch.testing.assert_close(ours, pipe.scheduler.sigmas.float(), rtol=0, atol=0)


def test_prepare_latents_match_pipeline(adapter, pipe):
    ours = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(5), torch.Generator().manual_seed(9)])
    for i, seed in enumerate((5, 9)):
        ref = pipe.prepare_latents(1, 4, 64, 64, torch.float32, "cpu", torch.Generator().manual_seed(seed))
        assert torch.equal(ours[i : i + 1], ref)
    assert ours.shape == (2, 4, 8, 8) and ours.dtype == torch.float32


def test_bad_input_raises(adapter, path, tmp_path):
    with pytest.raises(ValueError, match="height=72 must be a positive multiple of 16"):
        adapter.check_shape(SampleShape(72, 64))
    with pytest.raises(ValueError, match="width=40"):
        adapter.sigmas(4, SampleShape(64, 40))
    with pytest.raises(ValueError, match="num_frames"):
        adapter.check_shape(SampleShape(64, 64, num_frames=5))
    with pytest.raises(ValueError, match="missing_folder"):
        ZImageAdapter.from_pretrained(str(tmp_path / "missing_folder"))
    with pytest.raises(ValueError, match="cfg_normalization"):
        ZImageAdapter.from_pretrained(path, cfg_normalization=-1.0)
    enc = adapter.encode_prompt(["a cat"])
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(0)])
    with pytest.raises(ValueError, match="negative"):
        adapter.velocity(x, torch.tensor([0.5]), enc, None, guidance_scale=GUIDANCE, shape=SHAPE)
    loaded = load_adapter(path)
    assert isinstance(loaded, ZImageAdapter) and loaded.arch == "z_image" and loaded.source == path


def test_z_image_cfg_closed_form():
    g = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    scale = torch.tensor([4.0, 0.0, 2.0])
    out = z_image_cfg(cond, uncond, scale, 0.0)
    torch.testing.assert_close(out[0], 5 * cond[0] - 4 * uncond[0])
    torch.testing.assert_close(out[1], cond[1])
    capped = z_image_cfg(cond, uncond, scale, 0.5)
    norms = capped.flatten(1).norm(dim=1)
    torch.testing.assert_close(norms[[0, 2]], 0.5 * cond[[0, 2]].flatten(1).norm(dim=1))
    torch.testing.assert_close(capped[1], cond[1])  # no CFG at scale 0: not renormalised either


def test_velocity_is_differentiable_through_lora(path):
    adapter = ZImageAdapter.from_pretrained(path)
    names = [n for n, _ in adapter.transformer.named_modules()]
    for target in adapter.default_lora_targets:
        assert any(n.endswith("." + target) for n in names), target
    adapter.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(adapter.default_lora_targets)))
    enc, neg = adapter.encode_prompt(["a cat"]), adapter.encode_prompt([""])
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(0)])
    adapter.velocity(x, torch.tensor([0.7]), enc, neg, guidance_scale=GUIDANCE, shape=SHAPE).sum().backward()
    lora_b = {n: p for n, p in adapter.transformer.named_parameters() if "lora_B" in n}
    assert len(lora_b) == 7 * len(adapter.fsdp_wrap_units())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b.values())


def test_tiny_builder_is_deterministic_for_a_seed(tmp_path):
    from diffrl.models.tiny import build_tiny

    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        build_tiny("z_image", str(tmp_path / name), seed=seed)
    files = {
        name: {
            str(p.relative_to(tmp_path / name)): p.read_bytes()
            for p in sorted((tmp_path / name).rglob("*"))
            if p.is_file()
        }
        for name in "abc"
    }
    assert files["a"] == files["b"]
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert files["a"][weights] != files["c"][weights]
    assert "tokenizer/chat_template.jinja" in files["a"]  # ZImagePipeline calls apply_chat_template
    assert sum(len(b) for b in files["a"].values()) < 10_000_000
