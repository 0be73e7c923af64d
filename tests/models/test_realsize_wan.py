"""`diffrl random-model wan22_a14b` (diffrl/models/wan/realsize.py): the Wan2.2 T2V A14B layout at real size against
its published weight indexes, the 64 GB disk refused up front, and a scaled configs-only folder that loads through
`model.path: random:` and trains both experts for one step of the shipped DanceGRPO recipe."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from diffrl.configs.schema import load_experiment
from diffrl.engines import cluster
from diffrl.engines.step.run import DirectStages, run_step
from diffrl.engines.train.checkpoint import lora_state
from diffrl.flows.build import build_engines
from diffrl.models.base import SampleShape, load_adapter
from diffrl.models.realsize import DISK_MARGIN_BYTES, build_random, meta_counts, plan_for

# Published sizes of Wan-AI/Wan2.2-T2V-A14B-Diffusers: each expert's safetensors index total_size is 57,153,966,336
# bytes of fp32 = 14,288,491,584 values; text_encoder's 11,361,820,672 bytes of bf16 = 5,680,910,336 values. The VAE:
# 126,892,531 (Hugging Face's count for Qwen-Image's VAE, whose AutoencoderKLQwenImage has the same defaults as
# AutoencoderKLWan's: base_dim 96, z_dim 16, dim_mult [1, 2, 4, 4], 2 res blocks).
PUBLISHED = {
    "transformer": 14_288_491_584,
    "transformer_2": 14_288_491_584,
    "text_encoder": 5_680_910_336,
    "vae": 126_892_531,
}
SCALE = {  # the `scale` hook at toy size (as diffrl/models/wan/tiny.py builds its Wan2.2)
    "transformer": dict(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        rope_max_seq_len=64,
    ),
    "vae": dict(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        latents_mean=[0.1, -0.2, 0.05, 0.3],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    ),
    "text_encoder": dict(
        vocab_size=512,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
    ),
}
# The shipped recipe at toy size, on the CPU: 1 prompt x 2 samples, 4 steps at 16x16, 5 frames; every step trained
# (timestep fraction 1), so both experts' steps reach the update.
TINY_RECIPE = [
    "model.dtype=fp32",
    "model.device=cpu",
    "reward.components=[{name: jpeg_compressibility}]",
    "data.val=null",
    "data.num_generated=4",
    "data.num_val_prompts=0",
    "run.steps=1",
    "run.validate_every=0",
    "rollout.num_inference_steps=4",
    "rollout.height=16",
    "rollout.width=16",
    "rollout.num_frames=5",
    "rollout.max_sequence_length=16",
    "rollout.group_size=2",
    "rollout.prompts_per_step=1",
    "rollout.chunk_size=2",
    "rollout.batch_size=2",
    "algorithm={name: dance_grpo, window: {timestep_fraction: 1.0}}",
    "train.lora_rank=4",
    "train.lora_alpha=8",
    "train.lr=1.0e-3",
    "train.mini_batch_prompts=1",
    "train.micro_batch_size=2",
    "train.gradient_checkpointing=false",
]


def test_meta_parameter_counts_match_published():
    counts = meta_counts(plan_for("wan22_a14b"))
    assert set(counts) == set(PUBLISHED)
    for name, (parameters, stored) in counts.items():
        assert stored == pytest.approx(PUBLISHED[name], rel=0.01), name
    # the experts and the text encoder exactly (their indexes count parameters only)
    assert [counts[n][0] for n in ("transformer", "transformer_2", "text_encoder")] == [
        14_288_491_584,
        14_288_491_584,
        5_680_910_336,
    ]


def test_the_written_folder_is_refused_on_the_gpu_machines_64_gb_disk(tmp_path, monkeypatch):
    free = 64 * 10**9
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(free, 0, free))
    need = sum(stored for _, stored in meta_counts(plan_for("wan22_a14b")).values()) * 2 + DISK_MARGIN_BYTES
    assert 68.5e9 < need < 69.5e9  # ~68.8 GB in bf16
    out = tmp_path / "wan22"
    with pytest.raises(ValueError) as err:
        build_random("wan22_a14b", str(out), device="cpu", dtype=torch.bfloat16)
    assert "not enough disk space" in str(err.value) and "--configs-only" in str(err.value)
    assert f"{need:,} bytes" in str(err.value) and not os.path.exists(out) and not os.path.exists(f"{out}.tmp")


def test_real_size_configs_only_folder_has_the_published_layout(tmp_path):
    folder = build_random("wan22_a14b", str(tmp_path / "cfg"), device="cpu", weights=False)
    with open(os.path.join(folder, "model_index.json")) as f:
        index = json.load(f)
    assert index["_class_name"] == "WanPipeline" and index["boundary_ratio"] == 0.875
    assert index["expand_timesteps"] is False and index["scheduler"] == ["diffusers", "UniPCMultistepScheduler"]
    assert index["transformer"] == index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    with (
        open(os.path.join(folder, "transformer", "config.json")) as f,
        open(os.path.join(folder, "transformer_2", "config.json")) as g,
    ):
        high, low = json.load(f), json.load(g)
    assert high == low and (high["num_layers"], high["ffn_dim"], high["text_dim"]) == (40, 13824, 4096)
    with open(os.path.join(folder, "text_encoder", "config.json")) as f:
        text = json.load(f)
    assert (text["d_model"], text["num_layers"], text["vocab_size"], text["pad_token_id"]) == (4096, 24, 256384, 0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(folder, "tokenizer"))
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<pad>", "</s>", "<unk>")] == [0, 1, 2]
    assert len(tokenizer) < 256384 and "<extra_id_0>" in tokenizer.get_vocab()
    assert not [f for _, _, names in os.walk(folder) for f in names if f.endswith((".safetensors", ".bin"))]


def test_scaled_configs_only_folder_trains_both_experts_through_random_prefix(tmp_path):
    folder = build_random("wan22_a14b", str(tmp_path / "cfg"), device="cpu", scale=SCALE, weights=False)
    adapter = load_adapter(f"random:{folder}")
    assert adapter.boundary_ratio == 0.875 and adapter.pipe.transformer_2 is not None
    # 16 steps on the published UniPC flow schedule (shift 3): the first 5 timesteps are the high-noise expert's
    experts = adapter._expert_index(adapter.sigmas(16, SampleShape(16, 16, 5))[:-1] * 1000)
    assert experts.tolist() == [0] * 5 + [1] * 11

    cfg = load_experiment("wan22_dance_grpo", [f"model.path=random:{folder}", *TINY_RECIPE, "run.name=wan-scaled"])
    engines = build_engines(cfg, durable=False)
    try:
        before = {e: {k: v.clone() for k, v in t.items()} for e, t in lora_state(engines.trainer).items()}
        metrics = run_step(engines, 0, DirectStages(engines)).metrics
        engines.memory.drain()
        after = lora_state(engines.trainer)
    finally:
        cluster.drop("wan-scaled")
    assert metrics["actor/skipped_steps"] == 0 and torch.isfinite(torch.tensor(metrics["actor/grad_norm"]))
    assert set(after) == {"transformer", "transformer_2"}
    for expert, tensors in after.items():  # each expert's LoRA B moved off its zero init
        moved = [k for k, v in tensors.items() if "lora_B" in k and not torch.equal(v, before[expert][k])]
        assert moved and all(torch.isfinite(v).all() for v in tensors.values()), expert


def test_i2v_configs_only_folder_has_the_published_layout_and_loads_scaled(tmp_path):
    """`wan22_i2v_a14b`: Wan2.2-I2V-A14B's experts take 36 channels (4 mask + 2 x 16 latents), boundary 0.9, no image
    encoder; a scaled configs-only folder loads through `random:` as the image-to-video adapter and denoises."""
    counts = meta_counts(plan_for("wan22_i2v_a14b"))
    patch_extra = 20 * 5120 * 2 * 2  # the patch embedding's 20 more input channels
    assert counts["transformer"][0] == counts["transformer_2"][0] == 14_288_491_584 + patch_extra
    folder = build_random("wan22_i2v_a14b", str(tmp_path / "cfg"), device="cpu", weights=False)
    with open(os.path.join(folder, "model_index.json")) as f:
        index = json.load(f)
    assert index["_class_name"] == "WanImageToVideoPipeline" and index["boundary_ratio"] == 0.9
    assert index["image_encoder"] == [None, None] and index["expand_timesteps"] is False
    with open(os.path.join(folder, "transformer_2", "config.json")) as f:
        assert (json.load(f)["in_channels"], index["transformer_2"][1]) == (36, "WanTransformer3DModel")

    scale = {**SCALE, "transformer": {**SCALE["transformer"], "in_channels": 12}}
    small = build_random("wan22_i2v_a14b", str(tmp_path / "small"), device="cpu", scale=scale, weights=False)
    adapter = load_adapter(f"random:{small}")
    shape = SampleShape(16, 16, 5)
    # the recipe's 8 steps on the published UniPC flow schedule (shift 3): timesteps 999, 954 and 900 (>= 0.9 x 1000)
    # are the high-noise expert's, so wan22_i2v_flow_grpo's window on step 1 trains `transformer` alone
    assert adapter._expert_index(adapter.sigmas(8, shape)[:-1] * 1000).tolist() == [0] * 3 + [1] * 5
    frame = str(tmp_path / "frame.png")
    from PIL import Image

    Image.new("RGB", (16, 16), (200, 30, 30)).save(frame)
    encoding = adapter.encode_prompt(["a red wall"], images=[frame], shape=shape, max_sequence_length=8)
    latents = adapter.prepare_latents(shape, [torch.Generator().manual_seed(0)])
    velocity = adapter.velocity(latents, torch.ones(1), encoding, None, guidance_scale=1.0, shape=shape)
    assert adapter.arch == "wan_i2v" and velocity.shape == latents.shape == (1, 4, 2, 2, 2)
    assert torch.isfinite(velocity).all()
    with pytest.raises(ValueError, match="in_channels must be 12"):
        plan_for("wan22_i2v_a14b", SCALE)
