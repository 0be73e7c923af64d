"""Qwen-Image-Edit adapter on the tiny pipeline: the encoding equals upstream's `encode_prompt` and depends on the
image, batches of different input grids, and gradients reaching the LoRA targets. Parity of the whole sampling loop
with QwenImageEditPipeline at noise level 0 is tests/engines/rollout/test_rollout_edit.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig
from PIL import Image

from diffrl.models.base import SampleShape, detect_architecture
from diffrl.models.qwen_image.adapter_edit import QwenImageEditAdapter
from diffrl.shapes.edits import shapes_edit_prompts

SHAPE = SampleShape(64, 64)
TRUE_CFG = 4.0
NEGATIVE = " "
SMALL_AREA = 128 * 128  # a deviation from upstream's 1024 x 1024, to keep the non-parity tests fast


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("qwen_image_edit")


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    records = shapes_edit_prompts(2, seed=3, image_dir=str(tmp_path_factory.mktemp("edit_scenes"))).records
    return [r.prompt for r in records], [r.metadata["image"] for r in records]


def test_encoding_matches_upstream_and_depends_on_the_image(path, scenes):
    prompts, images = scenes
    adapter = QwenImageEditAdapter.from_pretrained(path, condition_area=SMALL_AREA)
    assert detect_architecture(path) == "qwen_image_edit" and adapter.input_image
    enc = adapter.encode_prompt(prompts[:1], images=images[:1])
    # upstream's own encode_prompt, given the image resized as the pipeline resizes it at this area
    image = Image.open(images[0]).convert("RGB")
    resized = adapter.pipe.image_processor.resize(image, 128, 128)
    ref_embeds, ref_mask = adapter.pipe.encode_prompt(prompt=prompts[0], image=resized, device="cpu")
    assert ref_mask is None  # a batch of one has no padding: upstream then passes no mask
    torch.testing.assert_close(enc["prompt_embeds"], ref_embeds, rtol=0, atol=0)
    assert enc["image_latents"].shape == (1, 64, 16) and enc["image_grid"].tolist() == [[8, 8]]
    other = adapter.encode_prompt(prompts[:1], images=images[1:2])
    assert enc["prompt_embeds"].shape[1] == other["prompt_embeds"].shape[1]  # 4 image tokens each
    assert (enc["prompt_embeds"] - other["prompt_embeds"]).abs().max() > 1e-3  # the vision tower sees the image
    assert (enc["image_latents"] - other["image_latents"]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="one image per prompt"):
        adapter.encode_prompt(prompts[:1])


def test_batched_velocity_equals_single_samples_and_mixed_grids(path, scenes):
    """A batch of two edits (different images and instructions, one with a wider input image) equals each alone."""
    prompts, images = scenes
    adapter = QwenImageEditAdapter.from_pretrained(path, condition_area=SMALL_AREA)
    wide = Image.fromarray(np.concatenate([np.asarray(Image.open(images[1]))] * 2, axis=1))
    encs = [adapter.encode_prompt([prompts[0]], images=[images[0]]), adapter.encode_prompt([prompts[1]], images=[wide])]
    negs = [adapter.encode_prompt([NEGATIVE], images=[images[0]]), adapter.encode_prompt([NEGATIVE], images=[wide])]
    assert encs[0]["image_grid"].tolist() != encs[1]["image_grid"].tolist()
    from diffrl.models.base import pad_and_cat

    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(s) for s in (1, 2)])
    sigma = torch.tensor([0.8, 0.8])
    with torch.no_grad():
        both = adapter.velocity(x, sigma, pad_and_cat(encs), pad_and_cat(negs), guidance_scale=TRUE_CFG, shape=SHAPE)
        alone = [
            adapter.velocity(x[i : i + 1], sigma[:1], encs[i], negs[i], guidance_scale=TRUE_CFG, shape=SHAPE)
            for i in range(2)
        ]
    torch.testing.assert_close(both, torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_lora_gradients_reach_the_targets(path, scenes):
    prompts, images = scenes
    adapter = QwenImageEditAdapter.from_pretrained(path, condition_area=SMALL_AREA)
    adapter.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(adapter.default_lora_targets)))
    enc = adapter.encode_prompt(prompts[:1], images=images[:1])
    neg = adapter.encode_prompt([NEGATIVE], images=images[:1])
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(0)])
    adapter.velocity(x, torch.tensor([0.7]), enc, neg, guidance_scale=TRUE_CFG, shape=SHAPE).sum().backward()
    lora_b = {n: p for n, p in adapter.transformer.named_parameters() if "lora_B" in n}
    num_blocks = len(adapter.transformer.transformer_blocks)
    assert len(lora_b) == 12 * num_blocks
    # As for Qwen-Image (tests/models/test_qwen_image.py): only the last block's text-stream-only modules get none.
    last = f"transformer_blocks.{num_blocks - 1}."
    text_only = ("attn.add_q_proj.", "attn.to_add_out.", "txt_mlp.")
    for name, p in lora_b.items():
        dead = name.startswith(last) and any(t in name for t in text_only)
        has_grad = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert has_grad != dead, name


def test_tiny_builder_is_deterministic_small_and_names_the_upstream_processor(tmp_path):
    import json

    from diffrl.models.tiny import build_tiny

    for name in ("a", "b"):
        build_tiny("qwen_image_edit", str(tmp_path / name), seed=0)
    files = [
        {str(p.relative_to(tmp_path / n)): p.read_bytes() for p in (tmp_path / n).rglob("*") if p.is_file()}
        for n in "ab"
    ]
    assert files[0] == files[1] and sum(len(b) for b in files[0].values()) < 10_000_000
    index = json.loads(files[0]["model_index.json"])
    assert index["_class_name"] == "QwenImageEditPipeline" and index["processor"] == [
        "transformers",
        "Qwen2VLProcessor",
    ]
