"""`diffrl random-model ltx2` (diffrl/models/ltx2/realsize.py): LTX-2's layout at real size on the meta device, and a
scaled configs-only folder that loads through `model.path: random:` and samples both streams."""

from __future__ import annotations

import json
import os

import torch

from diffrl.models.base import SampleShape, load_adapter
from diffrl.models.realsize import build_random, meta_counts, plan_for

# The counts in diffrl/models/ltx2/realsize.py's docstring: the transformer is the model card's "19B", Gemma-3-12B
# the published 12.2 B.
COUNTS = {
    "transformer": 18_876_174_592,
    "connectors": 1_431_475_200,
    "vae": 1_222_479_601,
    "audio_vae": 53_248_146,
    "vocoder": 55_592_802,
    "text_encoder": 12_187_325_040,
}
SCALE = {  # the tiny builder's sizes (diffrl/models/ltx2/tiny.py) through the `scale` hook
    "transformer": dict(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=2,
        caption_channels=32,
    ),
    "connectors": dict(
        caption_channels=32,
        text_proj_in_factor=3,
        video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8,
        video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8,
        audio_connector_num_learnable_registers=8,
    ),
    "vae": dict(
        latent_channels=4,
        block_out_channels=(4, 4, 4, 4),
        decoder_block_out_channels=(4, 8, 16),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        upsample_residual=(False, False, False),
    ),
    "audio_vae": dict(base_channels=4, ch_mult=(1,), num_res_blocks=1, latent_channels=2, mel_bins=8),
    "vocoder": dict(
        in_channels=16,
        hidden_channels=16,
        upsample_kernel_sizes=[10, 8, 8],
        upsample_factors=[5, 4, 4],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=8000,
    ),
    "text_encoder": dict(
        text_config=dict(
            vocab_size=1024,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=16,
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        boi_token_index=1021,
        eoi_token_index=1022,
        image_token_index=1023,
    ),
}


def test_meta_parameter_counts():
    assert {name: parameters for name, (parameters, _) in meta_counts(plan_for("ltx2")).items()} == COUNTS


def test_scaled_configs_only_folder_samples_video_and_audio(tmp_path):
    folder = build_random("ltx2", str(tmp_path / "cfg"), device="cpu", dtype=torch.float32, weights=False, scale=SCALE)
    with open(os.path.join(folder, "model_index.json")) as f:
        index = json.load(f)
    assert index["_class_name"] == "LTX2Pipeline" and index["text_encoder"][1] == "Gemma3ForConditionalGeneration"
    adapter = load_adapter(f"random:{folder}")
    shape = SampleShape(64, 64, 9)
    x = adapter.prepare_latents(shape, [torch.Generator().manual_seed(0)])
    enc = adapter.encode_prompt(["a cat"], max_sequence_length=32)
    with torch.no_grad():
        x = x - adapter.velocity(x, torch.tensor([1.0]), enc, None, guidance_scale=1.0, shape=shape)
    assert adapter.decode(x, shape).shape == (1, 9, 64, 64, 3)
    assert adapter.decode_audio(x, shape).shape == (1, 2, 2656) and adapter.audio_sample_rate == 8000
