"""`diffrl random-model flux2_klein` / `flux2_klein_4b` / `flux2_dev` (diffrl/models/flux2/realsize.py): the
real-size layouts against the published sizes, a configs-only folder through the CLI, a scaled one that loads through
`model.path: random:` and runs the adapter, and the FLUX.2-dev layout (guidance embedding, Mistral-3 text encoder) at
toy size against diffusers' Flux2Pipeline at noise level 0."""

from __future__ import annotations

import json
import os

import parity
import pytest
import torch
from diffusers import Flux2Pipeline

from diffrl.flows import cli
from diffrl.models.base import SampleShape, load_adapter
from diffrl.models.realsize import build_random, meta_counts, plan_for

# Qwen/Qwen3-8B and Qwen3-4B model cards: 8.2 B and 4.0 B parameters (rounded to 0.1 B); Mistral-Small-3.1-24B: 24 B.
# The transformers are named for their size (klein 9B / 4B, dev 32B), so they are checked within 5 %.
PUBLISHED = {
    "flux2_klein": {"text_encoder": (8.2e9, 0.01), "transformer": (9e9, 0.05)},
    "flux2_klein_4b": {"text_encoder": (4.0e9, 0.01), "transformer": (4e9, 0.05)},
    "flux2_dev": {"text_encoder": (24e9, 0.01), "transformer": (32e9, 0.05)},
}
# The `scale` hook at toy size (as diffrl/models/flux2/tiny.py builds it): the widths the pipeline joins still agree.
SCALE = {
    "transformer": dict(
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=48,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
    ),
    "vae": dict(
        block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=64
    ),
    "text_encoder": dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=28,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    ),
}

TEXT = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
DEV_SCALE = dict(
    SCALE,
    transformer=dict(SCALE["transformer"], guidance_embeds=True),
    text_encoder=dict(
        text_config=dict(TEXT, num_hidden_layers=31, vocab_size=8192),
        vision_config=dict(TEXT, num_hidden_layers=1, image_size=28),
    ),
)


@pytest.mark.parametrize("arch", ["flux2_klein", "flux2_klein_4b", "flux2_dev"])
def test_meta_parameter_counts_match_published(arch):
    counts = meta_counts(plan_for(arch))
    for name, (published, tolerance) in PUBLISHED[arch].items():
        assert abs(counts[name][0] - published) <= tolerance * published, (name, counts[name])


def test_cli_writes_the_real_size_configs_only_folder(tmp_path, capsys):
    out = str(tmp_path / "klein")
    assert cli.main(["random-model", "flux2_klein", out, "--configs-only"]) == 0
    assert f"model.path=random:{out}" in capsys.readouterr().err
    with open(os.path.join(out, "model_index.json")) as f:
        index = json.load(f)
    assert index["_class_name"] == "Flux2KleinPipeline" and index["is_distilled"] is False
    with open(os.path.join(out, "transformer", "config.json")) as f:
        transformer = json.load(f)
    assert (transformer["num_layers"], transformer["num_single_layers"], transformer["joint_attention_dim"]) == (
        8,
        24,
        12288,
    )
    assert not [f for _, _, names in os.walk(out) for f in names if f.endswith(".safetensors")]


def test_scaled_configs_only_folder_loads_with_random_weights_and_samples(tmp_path):
    folder = build_random("flux2_klein", str(tmp_path / "cfg"), device="cpu", scale=SCALE, weights=False)
    adapter = load_adapter(f"random:{folder}")
    assert adapter.arch == "flux2" and adapter.needs_negative(4.0)
    shape = SampleShape(32, 32)
    enc, neg = adapter.encode_prompt(['A sign that reads "Hidden Trail"']), adapter.encode_prompt([""])
    x = adapter.prepare_latents(shape, [torch.Generator().manual_seed(7)])
    with torch.no_grad():
        v = adapter.velocity(x, adapter.sigmas(2, shape)[:1], enc, neg, guidance_scale=4.0, shape=shape)
        image = adapter.decode(x + v, shape)
    assert torch.isfinite(v).all() and v.std() > 0 and image.shape == (1, 32, 32, 3)


def test_dev_layout_matches_flux2_pipeline_with_its_guidance_embedding(tmp_path):
    folder = build_random("flux2_dev", str(tmp_path / "dev"), device="cpu", dtype=torch.float32, scale=DEV_SCALE)
    adapter = load_adapter(folder)
    assert adapter.guidance_distilled and not adapter.needs_negative(4.0)
    pipe = Flux2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    shape, prompt = SampleShape(32, 32), "a red bicycle"
    ours = parity.euler_sample(adapter, [prompt], [5], guidance_scale=4.0, shape=shape, steps=2, negative=None)
    ref = parity.pipeline_uint8(pipe, prompt, 5, shape=shape, steps=2, guidance_scale=4.0)
    assert (ours.int() - ref.int()).abs().max() <= 1 and ref.float().std() > 5
