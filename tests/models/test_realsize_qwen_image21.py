"""`diffrl random-model qwen_image21` (diffrl/models/qwen_image21/realsize.py): the real-size layout against published
sizes on the meta device, and a scaled configs-only folder that loads through `model.path: random:` and samples."""

from __future__ import annotations

import json
import os

import pytest
import torch

from diffrl.models.base import SampleShape, load_adapter
from diffrl.models.causal_lm.realsize_qwen3_vl import PARAMETERS_8B
from diffrl.models.realsize import build_random, meta_counts, plan_for

SCALE = {  # the `scale` hook at toy size (as diffrl/models/qwen_image21/tiny.py builds it)
    "transformer": dict(
        in_channels=8,
        out_channels=8,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=32,
        mlp_ratio=2,
        axes_dims_rope=(4, 6, 6),
    ),
    "vae": dict(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=8,
        dim_mult=[1, 1, 2, 2, 2],
        num_res_blocks=1,
        latents_mean=[0.0] * 8,
        latents_std=[1.0] * 8,
    ),
    "text_encoder": {
        "text_config": dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            rope_scaling=dict(mrope_section=[2, 3, 3]),
        ),
        "vision_config": dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, deepstack_visual_indexes=[0]
        ),
    },
}


def test_meta_parameter_counts_match_published():
    counts = meta_counts(plan_for("qwen_image21"))
    assert set(counts) == {"transformer", "vae", "text_encoder"}
    # Qwen/Qwen3-VL-8B-Instruct: the model card's 8.77 B, counted exactly in tests/models/test_qwen3_vl_config.py.
    assert counts["text_encoder"][0] == PARAMETERS_8B
    # "7B parameters in the visual generation component" (the release's summary).
    assert counts["transformer"][0] == pytest.approx(7e9, rel=0.03)
    assert counts["vae"][0] < 0.5e9


def test_configs_only_folder_loads_and_samples(tmp_path, capsys):
    folder = build_random("qwen_image21", str(tmp_path / "cfg"), device="cpu", scale=SCALE, weights=False)
    assert "configs only" in capsys.readouterr().err
    files = [f for _, _, names in os.walk(folder) for f in names]
    assert not [f for f in files if f.endswith((".safetensors", ".bin"))] and "config.json" in files
    with open(os.path.join(folder, "model_index.json")) as f:
        assert json.load(f)["processor"] == ["transformers", "Qwen3VLProcessor"]  # as the released folder names it
    adapter = load_adapter(f"random:{folder}", dtype=torch.bfloat16)
    assert adapter.arch == "qwen_image21" and adapter.pipe._drop_idx > 0
    shape = SampleShape(64, 64)
    prompt = 'A storefront sign that reads "Hidden Trail"'
    enc = adapter.encode_prompt([prompt])
    # What is kept: the template's user turn and the prompt, after the system message the pipeline drops.
    tokens = adapter.pipe.processor.tokenizer(adapter.pipe.prompt_template_t2i.format(prompt)).input_ids
    assert int(enc["prompt_embeds_mask"].sum()) == len(tokens) - adapter.pipe._drop_idx
    x = adapter.prepare_latents(shape, [torch.Generator().manual_seed(7)])
    with torch.no_grad():
        v = adapter.velocity(x, adapter.sigmas(2, shape)[:1], enc, None, guidance_scale=1.0, shape=shape)
    assert v.shape == (1, 16, 8) and torch.isfinite(v).all() and v.float().std() > 0
    image = adapter.decode(x + v * -0.5, shape)
    assert image.shape == (1, 64, 64, 3) and image.dtype == torch.uint8
