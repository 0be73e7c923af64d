"""HunyuanVideo-1.5 adapter on the tiny "hunyuan_video15" pipeline: parity with diffusers' HunyuanVideo15Pipeline at
noise level 0, both prompt encodings (Qwen2.5-VL and the ByT5 glyph text), sigmas, noise, shapes, gradients."""

from __future__ import annotations

import functools

import numpy as np
import parity
import pytest
import torch
from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline
from peft import LoraConfig

from diffrl.models.base import SampleShape, load_adapter
from diffrl.models.hunyuan_video15.adapter import HunyuanVideo15Adapter

SHAPE = SampleShape(32, 32, num_frames=5)  # latents (4, 2, 2, 2)
GUIDANCE = 6.0  # the 480p/720p T2V folders' ClassifierFreeGuidance
GLYPH_PROMPT = 'a red sign that says "OPEN" above a small shop'


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("hunyuan_video15")


@pytest.fixture(scope="module")
def adapter(path):
    return HunyuanVideo15Adapter.from_pretrained(path)


@pytest.fixture(scope="module")
def pipe(path):
    pipe = HunyuanVideo15Pipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


euler_sample = functools.partial(parity.euler_sample, guidance_scale=GUIDANCE, shape=SHAPE)


def pipeline_uint8(pipe, prompt, seed, *, guidance_scale=GUIDANCE, negative=None, shape=SHAPE, steps=4):
    """The pipeline's frames (1, F, H, W, 3) uint8; its guidance scale is its guider's."""
    pipe.guider = ClassifierFreeGuidance(guidance_scale=guidance_scale)
    frames = pipe(
        prompt=prompt,
        negative_prompt=negative,
        height=shape.height,
        width=shape.width,
        num_frames=shape.num_frames,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    ).frames
    return torch.from_numpy((frames * 255).round().astype("uint8"))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.int() - b.int()).abs().max())


def test_noise_level_0_batch_matches_pipeline(adapter, pipe):
    """A batch of two (one prompt with quoted text for the glyph encoder, one without) with a negative prompt, CFG in
    one forward, against one pipeline call per prompt; guidance visibly changes the video."""
    prompts, seeds = [GLYPH_PROMPT, "a boat on the ocean"], [7, 11]
    ours = euler_sample(adapter, prompts, seeds, negative="blurry")
    assert ours.shape == (2, 5, 32, 32, 3) and ours.dtype == torch.uint8
    for i in range(2):
        ref = pipeline_uint8(pipe, prompts[i], seeds[i], negative="blurry")
        assert max_diff(ours[i : i + 1], ref) <= 1
        assert ref.float().std() > 5  # a real video, not a constant
    unguided = euler_sample(adapter, prompts[:1], seeds[:1], guidance_scale=1.0)
    assert not adapter.needs_negative(1.0)
    assert max_diff(unguided, pipeline_uint8(pipe, prompts[0], seeds[0], guidance_scale=1.0)) <= 1
    assert (unguided.float() - ours[:1].float()).abs().mean() > 2


def _valid(embeds, mask):
    """Each row's valid tokens (where mask is 1), as the transformer reorders them."""
    return [e[m.bool()] for e, m in zip(embeds, mask)]


def test_encode_prompt_equals_pipeline_valid_tokens(adapter, pipe):
    prompts = [GLYPH_PROMPT, "", "two dogs in a park"]
    with torch.no_grad():
        ref = pipe.encode_prompt(prompts, device="cpu", batch_size=3)
    ours = adapter.encode_prompt(prompts)
    assert set(ours) == {"prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2"}
    # Upstream pads to 1000 Qwen and 256 ByT5 tokens; ours keeps the valid ones, right-padded to the batch's longest.
    assert ref[0].shape[1] == 1000 and ref[2].shape[1] == 256
    assert ours["prompt_embeds"].shape[1] == int(ref[1].sum(1).max()) < 1000
    for key, mask_key, (ref_embeds, ref_mask) in [
        ("prompt_embeds", "prompt_embeds_mask", ref[:2]),
        ("prompt_embeds_2", "prompt_embeds_mask_2", ref[2:]),
    ]:
        assert ours[mask_key].dtype == torch.int64
        for mine, theirs in zip(_valid(ours[key], ours[mask_key]), _valid(ref_embeds, ref_mask)):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        assert (ours[key][ours[mask_key] == 0] == 0).all()
    # Only the first prompt has quoted text: "OPEN" is 'Text "OPEN". ' in ByT5 bytes plus </s>.
    assert ours["prompt_embeds_mask_2"].sum(1).tolist() == [len(b'Text "OPEN". ') + 1, 0, 0]
    # The template's 108-token prefix is what upstream crops: the empty prompt (sent as " ") keeps " ", <|im_end|>,
    # "\n", <|im_start|>, "assistant", "\n".
    assert ours["prompt_embeds_mask"][1].sum() == 6


def test_too_long_prompt_warns_and_truncates(adapter, pipe):
    long_prompt = "a photo of a cat sitting on a red chair next to a window"
    with pytest.warns(UserWarning, match=r"prompt 0 has \d+ tokens, more than max_sequence_length=6: truncated"):
        enc = adapter.encode_prompt([long_prompt], max_sequence_length=6)
    assert enc["prompt_embeds"].shape[1] == 6
    with pytest.raises(ValueError, match="max_sequence_length=0"):
        adapter.encode_prompt(["a cat"], max_sequence_length=0)


def test_sigmas_equal_pipeline_scheduler(adapter, pipe):
    pipeline_uint8(pipe, "a cat", 0, guidance_scale=1.0, shape=SampleShape(16, 16, 1), steps=6)  # leaves its sigmas
    ours = adapter.sigmas(6, SHAPE)
    assert ours.dtype == torch.float32 and ours.shape == (7,) and ours[0] == 1 and ours[-1] == 0
    torch.testing.assert_close(ours, pipe.scheduler.sigmas, rtol=0, atol=0)
    t = np.linspace(1.0, 0.0, 7)[:-1]  # closed form: the static shift 5 on linspace(1, 0)
    np.testing.assert_allclose(ours[:-1].numpy(), 5 * t / (1 + 4 * t), rtol=1e-6)


def test_prepare_latents_shapes_and_errors(adapter, path, tmp_path):
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)])
    assert x.shape == (2, 4, 2, 2, 2) and x.dtype == torch.float32  # 16x spatial, (5 - 1) // 4 + 1 latent frames
    torch.testing.assert_close(x[1:], torch.randn((1, 4, 2, 2, 2), generator=torch.Generator().manual_seed(8)))
    with pytest.raises(ValueError, match=r"num_frames=4 must be k \* 4 \+ 1"):
        adapter.check_shape(SampleShape(64, 64, num_frames=4))
    with pytest.raises(ValueError, match=r"height=40 must be a positive multiple of 16"):
        adapter.prepare_latents(SampleShape(40, 64, 5), [torch.Generator()])
    loaded = load_adapter(path)
    assert isinstance(loaded, HunyuanVideo15Adapter) and loaded.is_video and loaded.arch == "hunyuan_video15"
    assert len(loaded.fsdp_wrap_units()) == 2
    # A guider diffrl does not reproduce (here: CFG rescale) is refused at load.
    pipe = HunyuanVideo15Pipeline.from_pretrained(path)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=6.0, guidance_rescale=0.7)
    pipe.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="guidance_rescale"):
        HunyuanVideo15Adapter.from_pretrained(str(tmp_path))


def test_bucketed_text_and_lora_gradients(path):
    """Padding both texts to their compile buckets leaves the velocity unchanged (padded tokens are masked), and the
    velocity is differentiable w.r.t. a LoRA on every default target."""
    adapter = HunyuanVideo15Adapter.from_pretrained(path)
    enc, neg = adapter.encode_prompt([GLYPH_PROMPT, "a cat"]), adapter.encode_prompt(["", ""])
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)])
    sigma = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        plain = adapter.velocity(x, sigma, enc, neg, guidance_scale=GUIDANCE, shape=SHAPE)
        adapter.compiled = True  # what compile_blocks sets: text padded to text_bucket lengths
        bucketed = adapter.velocity(x, sigma, enc, neg, guidance_scale=GUIDANCE, shape=SHAPE)
        adapter.compiled = False
    torch.testing.assert_close(bucketed, plain, rtol=1e-5, atol=1e-5)
    model = adapter.transformer
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(adapter.default_lora_targets)))
    lora_modules = {n for n, _ in model.named_modules() if n.endswith("lora_B.default")}
    for target in adapter.default_lora_targets:
        assert any(n.endswith(f"{target}.lora_B.default") for n in lora_modules), target
    adapter.velocity(x, sigma, enc, neg, guidance_scale=GUIDANCE, shape=SHAPE).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_B" in n}
    # Every target learns somewhere; the last block's text-stream query and output (add_q_proj, to_add_out) get no
    # gradient, since the transformer drops the text states after it.
    for target in adapter.default_lora_targets:
        assert any(f".{target}.lora_B" in n and g is not None and g.abs().sum() > 0 for n, g in grads.items()), target
    last = len(model.transformer_blocks) - 1
    assert grads[f"transformer_blocks.{last}.attn.to_add_out.lora_B.default.weight"] is None
    with pytest.raises(ValueError, match="negative"):
        adapter.velocity(x, sigma, enc, None, guidance_scale=GUIDANCE, shape=SHAPE)
