"""Qwen-Image adapter on the tiny Qwen-Image pipeline: parity with diffusers' QwenImagePipeline."""

from __future__ import annotations

import functools

import parity
import pytest
import torch
from diffusers import QwenImagePipeline
from peft import LoraConfig

from diffrl.models.base import SampleShape, load_adapter
from diffrl.models.qwen_image.adapter import QwenImageAdapter, true_cfg

SHAPE = SampleShape(64, 64)
TRUE_CFG = 4.0
NEGATIVE = " "


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("qwen_image")


@pytest.fixture(scope="module")
def adapter(path):
    return QwenImageAdapter.from_pretrained(path)


@pytest.fixture(scope="module")
def pipe(path):
    pipe = QwenImagePipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# this architecture's defaults for the shared noise-level-0 loop
euler_sample = functools.partial(parity.euler_sample, guidance_scale=TRUE_CFG, shape=SHAPE, negative=NEGATIVE)


def pipeline_uint8(pipe, prompt, seed, *, steps=4, true_cfg_scale=TRUE_CFG, shape=SHAPE, negative=NEGATIVE):
    return parity.pipeline_uint8(
        pipe, prompt, seed, shape=shape, steps=steps, negative_prompt=negative, true_cfg_scale=true_cfg_scale
    )


def test_noise_level_0_matches_pipeline_with_true_cfg(adapter, pipe):
    ours = euler_sample(adapter, ["a photo of a cat"], [7])
    ref = pipeline_uint8(pipe, "a photo of a cat", 7)
    assert ours.shape == (1, 64, 64, 3) and ours.dtype == torch.uint8
    assert (ours.int() - ref.int()).abs().max() <= 1
    assert ref.float().std() > 5  # a real image, not a constant
    # Guidance matters: without the negative prompt the image is different.
    assert (pipeline_uint8(pipe, "a photo of a cat", 7, negative=None).int() - ref.int()).abs().max() > 1


def test_batch_of_two_equals_single_runs(adapter, pipe):
    prompts, seeds = ["a red bicycle", "an astronaut riding a horse on the moon, digital art"], [7, 11]
    ours = euler_sample(adapter, prompts, seeds)
    for i in range(2):
        ref = pipeline_uint8(pipe, prompts[i], seeds[i])[0]
        assert (ours[i].int() - ref.int()).abs().max() <= 1


def test_without_negative_prompt_matches_pipeline(adapter, pipe):
    # Upstream runs no CFG without a negative prompt, whatever true_cfg_scale; also a non-square size.
    shape = SampleShape(48, 80)
    ours = euler_sample(adapter, ["a bowl of fruit"], [3], negative=None, shape=shape, steps=3)
    ref = pipeline_uint8(pipe, "a bowl of fruit", 3, negative=None, shape=shape, steps=3)
    assert (ours.int() - ref.int()).abs().max() <= 1


def test_encode_prompt_equals_pipeline(adapter, pipe):
    prompts = ["a cat", "Two dogs playing with a ball in a green park, 4k"]
    ref_embeds, ref_mask = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=512)
    enc = adapter.encode_prompt(prompts)
    torch.testing.assert_close(enc["prompt_embeds"], ref_embeds, rtol=0, atol=0)
    assert torch.equal(enc["prompt_embeds_mask"], ref_mask)
    assert enc["prompt_embeds_mask"][0].sum() < enc["prompt_embeds_mask"][1].sum()  # padding present
    # One prompt alone: upstream drops its all-ones mask; ours keeps it, all ones.
    single_embeds, single_mask = pipe.encode_prompt(["a cat"], device="cpu")
    single = adapter.encode_prompt(["a cat"])
    assert single_mask is None and bool(single["prompt_embeds_mask"].all())
    torch.testing.assert_close(single["prompt_embeds"], single_embeds, rtol=0, atol=0)


def test_long_prompt_warns_and_truncates_as_upstream(adapter, pipe):
    prompt = "a very long prompt about a castle in the clouds, fantasy, vibrant colors, highly detailed"
    with pytest.warns(UserWarning, match=r"max_sequence_length=8: it is truncated to 8"):
        enc = adapter.encode_prompt([prompt], max_sequence_length=8)
    ref_embeds, _ = pipe.encode_prompt([prompt], device="cpu", max_sequence_length=8)
    assert enc["prompt_embeds"].shape[1] == 8
    torch.testing.assert_close(enc["prompt_embeds"], ref_embeds, rtol=0, atol=0)
    with pytest.raises(ValueError, match="max_sequence_length"):
        adapter.encode_prompt([prompt], max_sequence_length=2048)


@pytest.mark.parametrize("steps,height,width", [(4, 64, 64), (3, 128, 96)])
def test_sigmas_equal_pipeline_scheduler(adapter, pipe, steps, height, width):
    pipe(
        prompt="a cat",
        num_inference_steps=steps,
        height=height,
        width=width,
        true_cfg_scale=1.0,
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
    assert ours.shape == (2, 16, 16) and ours.dtype == torch.float32


def test_bad_shapes_and_paths_raise(adapter, path, tmp_path):
    with pytest.raises(ValueError, match="height=72 must be a positive multiple of 16"):
        adapter.check_shape(SampleShape(72, 64))
    with pytest.raises(ValueError, match="width=40"):
        adapter.sigmas(4, SampleShape(64, 40))
    with pytest.raises(ValueError, match="num_frames"):
        adapter.check_shape(SampleShape(64, 64, num_frames=5))
    with pytest.raises(ValueError, match="missing_folder"):
        QwenImageAdapter.from_pretrained(str(tmp_path / "missing_folder"))
    loaded = load_adapter(path)
    assert isinstance(loaded, QwenImageAdapter) and loaded.arch == "qwen_image" and loaded.source == path


def test_batched_cfg_forward_equals_two_forwards(adapter):
    """One padded cond+uncond forward gives the same velocity as upstream's two separate forwards."""
    enc = adapter.encode_prompt(["an elephant walking across the savanna at sunset", "a cat"])
    neg = adapter.encode_prompt([NEGATIVE, NEGATIVE])
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(s) for s in (1, 2)])
    sigma = torch.tensor([0.9, 0.4])  # mixed timesteps within a batch
    with torch.no_grad():
        ours = adapter.velocity(x, sigma, enc, neg, guidance_scale=TRUE_CFG, shape=SHAPE)
        img_shapes = [[(1, 4, 4)]] * 2

        def forward(e):  # upstream call: timestep / 1000, mask dropped when nothing is padded
            mask = None if e["prompt_embeds_mask"].all() else e["prompt_embeds_mask"]
            return adapter.transformer(
                hidden_states=x,
                timestep=sigma * 1000 / 1000,
                encoder_hidden_states=e["prompt_embeds"],
                encoder_hidden_states_mask=mask,
                img_shapes=img_shapes,
                return_dict=False,
            )[0]

        cond, uncond = forward(enc), forward(neg)
    comb = uncond + TRUE_CFG * (cond - uncond)
    ref = comb * cond.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    assert neg["prompt_embeds"].shape[1] != enc["prompt_embeds"].shape[1]  # padding was really needed


def test_true_cfg_keeps_conditional_norm():
    g = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    out = true_cfg(cond, uncond, 3.0)
    torch.testing.assert_close(out.norm(dim=-1), cond.norm(dim=-1))
    direction = uncond + 3.0 * (cond - uncond)
    cos = torch.nn.functional.cosine_similarity(out, direction, dim=-1)
    torch.testing.assert_close(cos, torch.ones_like(cos))


def test_velocity_is_differentiable_through_lora(path):
    adapter = QwenImageAdapter.from_pretrained(path)
    names = [n for n, _ in adapter.transformer.named_modules()]
    for target in adapter.default_lora_targets:
        assert any(n.endswith("." + target) for n in names), target
    adapter.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(adapter.default_lora_targets)))
    enc, neg = adapter.encode_prompt(["a cat"]), adapter.encode_prompt([NEGATIVE])
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(0)])
    adapter.velocity(x, torch.tensor([0.7]), enc, neg, guidance_scale=TRUE_CFG, shape=SHAPE).sum().backward()
    lora_b = {n: p for n, p in adapter.transformer.named_parameters() if "lora_B" in n}
    num_blocks = len(adapter.transformer.transformer_blocks)
    assert len(lora_b) == 12 * num_blocks
    # The last block's text-stream output is discarded by the model, so exactly the modules that only
    # feed it (text query, text out-projection, text MLP) get no gradient there; all others do.
    last = f"transformer_blocks.{num_blocks - 1}."
    text_only = ("attn.add_q_proj.", "attn.to_add_out.", "txt_mlp.")
    for name, p in lora_b.items():
        dead = name.startswith(last) and any(t in name for t in text_only)
        has_grad = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert has_grad != dead, name


def _folder_bytes(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_tiny_builder_is_deterministic_for_a_seed(tmp_path):
    from diffrl.models.tiny import build_tiny

    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        build_tiny("qwen_image", str(tmp_path / name), seed=seed)
    files_a, files_b, files_c = (_folder_bytes(tmp_path / name) for name in ("a", "b", "c"))
    assert files_a == files_b
    assert (
        files_a["transformer/diffusion_pytorch_model.safetensors"]
        != files_c["transformer/diffusion_pytorch_model.safetensors"]
    )
    assert sum(len(b) for b in files_a.values()) < 10_000_000
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in files_a)  # safetensors only


def test_tiny_tokenizer_drops_exactly_the_template_prefix(pipe):
    # Like Qwen's real vocabulary, the tiny one holds each template word as one token, so upstream's
    # fixed drop of 34 tokens removes exactly the system turn and the user-turn header.
    tok = pipe.tokenizer
    ids = tok(pipe.prompt_template_encode.format("a photo of a cat")).input_ids
    drop = pipe.prompt_template_encode_start_idx
    assert drop == 34
    assert tok.decode(ids[:drop]).endswith("<|im_start|>user\n")
    assert tok.decode(ids[drop:]) == "a photo of a cat<|im_end|>\n<|im_start|>assistant\n"
    assert tok.pad_token == "<|endoftext|>" and tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
