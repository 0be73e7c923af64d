"""`diffrl random-model hunyuan_video15_480p` (diffrl/models/hunyuan_video15/realsize.py): the HunyuanVideo-1.5 480p
T2V layout at real size against its published sizes, and a scaled configs-only folder that loads through
`model.path: random:` and denoises."""

from __future__ import annotations

import json
import os

import pytest
import torch

from diffrl.models.base import SampleShape, load_adapter
from diffrl.models.realsize import build_random, meta_counts, plan_for

# Published: the model card's 8.3 B parameters (the transformer); Qwen/Qwen2.5-VL-7B-Instruct's 8,292,166,656 less
# its vision tower (676,550,144) and lm_head (152,064 x 3,584), which the pipeline's Qwen2_5_VLTextModel leaves out.
PUBLISHED = {"transformer": 8.3e9, "text_encoder": 8_292_166_656 - 676_550_144 - 152_064 * 3_584}
SCALE = {  # the `scale` hook at toy size (as diffrl/models/hunyuan_video15/tiny.py builds it)
    "transformer": dict(
        in_channels=9,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=1,
        num_refiner_layers=1,
        text_embed_dim=32,
        text_embed_2_dim=32,
        image_embed_dim=16,
        rope_axes_dim=(4, 6, 6),
    ),
    "vae": dict(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1),
    "text_encoder": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3]),
    ),
    "text_encoder_2": dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4),
}


def test_real_size_counts_and_a_scaled_random_folder_samples(tmp_path):
    counts = {name: n for name, (n, _) in meta_counts(plan_for("hunyuan_video15_480p")).items()}
    assert counts["transformer"] == pytest.approx(PUBLISHED["transformer"], rel=0.01)
    assert counts["text_encoder"] == PUBLISHED["text_encoder"]
    assert set(counts) == {"transformer", "vae", "text_encoder", "text_encoder_2"}
    small = build_random("hunyuan_video15_480p", str(tmp_path / "small"), device="cpu", scale=SCALE, weights=False)
    with open(os.path.join(small, "model_index.json")) as f:
        index = json.load(f)
    assert index["_class_name"] == "HunyuanVideo15Pipeline" and index["guider"][1] == "ClassifierFreeGuidance"
    adapter = load_adapter(f"random:{small}")
    shape = SampleShape(16, 16, 5)
    # the published schedule: shift 5 on linspace(1, 0); the guider's 6.0 is plain CFG, which the adapter accepts
    assert adapter.sigmas(2, shape).tolist() == pytest.approx([1.0, 5 * 0.5 / (1 + 4 * 0.5), 0.0])
    encoding = adapter.encode_prompt(['a sign that says "HELLO"'], max_sequence_length=16)
    latents = adapter.prepare_latents(shape, [torch.Generator().manual_seed(0)])
    velocity = adapter.velocity(latents, torch.ones(1), encoding, None, guidance_scale=1.0, shape=shape)
    assert velocity.shape == latents.shape == (1, 4, 2, 1, 1) and torch.isfinite(velocity).all()
    with pytest.raises(ValueError, match="text_embed_dim=3584 must equal"):
        plan_for("hunyuan_video15_480p", {"text_encoder": SCALE["text_encoder"]})
