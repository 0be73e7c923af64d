"""Reference shapes model pretraining: text encoding matches the pipeline, a short CPU run lowers the
flow-matching loss and saves a folder that diffusers and our SD3 adapter load offline."""

import json
import math
import os

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from diffrl.models.base import SampleShape, load_adapter
from diffrl.shapes.pretrain.sd3 import encode_text, logit_normal_sigmas, lr_factor, parse_args, run, tokenize
from diffrl.shapes.pretrain.sd3_model import PretrainConfig, build_pipeline

TINY = dict(
    device="cpu",
    seed=0,
    batch_size=8,
    lr=2e-3,
    warmup=5,
    width=32,
    layers=1,
    text_width=16,
    text_layers=2,
    num_images=64,
    vae_steps=10,
    vae_batch=8,
    eval_prompts=2,
    eval_steps=2,
    workers=1,
    log_every=10,
)


def test_encode_text_equals_the_pipeline_and_t5_outputs_zeros():
    pipe = build_pipeline(PretrainConfig(out="", **TINY))
    prompts = ["two red circles", "a square to the left of a triangle", ""]
    ids = [tokenize(tok, prompts) for tok in (pipe.tokenizer, pipe.tokenizer_2)]
    with torch.no_grad():
        ours = encode_text(pipe, *ids, num_zero_tokens=8)
        theirs = pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device="cpu",
            do_classifier_free_guidance=False,
            max_sequence_length=8,
        )
    assert ours[0].shape == (3, 77 + 8, 32)
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)
    torch.testing.assert_close(ours[1], theirs[2], rtol=0, atol=0)


def test_cpu_sized_layout_halves_the_latent_side_and_shortens_clip():
    """--vae-levels 2 --text-tokens 24: 32 x 32 latents (64 image tokens at patch 4), 24 CLIP tokens, and the
    pipeline itself encodes and samples 64 x 64 images with it."""
    pipe = build_pipeline(PretrainConfig(out="", **{**TINY, "layers": 2}, vae_levels=2, text_tokens=24))
    assert pipe.vae_scale_factor == 2 and pipe.transformer.config.sample_size == 32
    prompts = ["a yellow circle and a purple square", ""]  # the longest shapes caption: 24 CLIP tokens
    ids = [tokenize(tok, prompts) for tok in (pipe.tokenizer, pipe.tokenizer_2)]
    assert ids[0].shape == (2, 24) and ids[0][0, -1] == pipe.tokenizer.eos_token_id  # fits, not cut
    with torch.no_grad():
        ours = encode_text(pipe, *ids, num_zero_tokens=32)
        theirs = pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device="cpu",
            do_classifier_free_guidance=False,
            max_sequence_length=32,
        )
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)
    image = pipe(
        "a red circle",
        num_inference_steps=2,
        guidance_scale=1.0,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images
    assert image.shape == (1, 64, 64, 3)


def test_logit_normal_sigmas_shift_maps_the_median():
    g = torch.Generator().manual_seed(0)
    s = logit_normal_sigmas(20000, 3.0, g, "cpu")
    # median of sigmoid(N(0,1)) is 0.5; the shift maps it to 3 * 0.5 / (1 + 2 * 0.5) = 0.75.
    assert 0 < s.min() and s.max() < 1 and s.median().item() == pytest.approx(0.75, abs=0.01)


def test_lr_schedules_warm_up_then_hold_or_follow_a_cosine_to_zero():
    # Warm-up (step + 1) / warmup in both; then constant 1, or 0.5 (1 + cos(pi (step - warmup) / (steps - warmup))).
    assert [lr_factor(s, 100, 10, "constant") for s in (0, 4, 9, 50, 99)] == pytest.approx([0.1, 0.5, 1, 1, 1])
    assert [lr_factor(s, 100, 10, "cosine") for s in (0, 9, 10, 55, 100)] == pytest.approx([0.1, 1, 1, 0.5, 0])
    assert lr_factor(40, 100, 10, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 3)))
    assert lr_factor(750, 1500, 0, "cosine") == pytest.approx(0.5)  # the VAE's schedule: no warm-up
    cfg = parse_args(["--out", "x", "--device", "cpu", "--lr-schedule", "cosine", "--vae-lr-schedule", "cosine"])
    assert (cfg.lr_schedule, cfg.vae_lr_schedule) == ("cosine", "cosine")
    assert PretrainConfig(out="x", device="cpu").lr_schedule == "constant"  # the shipped models' recipe


def test_bad_flags_are_named():
    with pytest.raises(ValueError, match="--device must be cpu or cuda"):
        PretrainConfig(out="x", device="tpu")
    with pytest.raises(ValueError, match="--width must be a multiple of 32"):
        PretrainConfig(out="x", device="cpu", width=48)
    with pytest.raises(ValueError, match="--vae-levels must be 1, 2 or 3"):
        PretrainConfig(out="x", device="cpu", vae_levels=4)
    with pytest.raises(ValueError, match="--patch-size must be 1, 2, 4 or 8 and at most the latent side 16"):
        PretrainConfig(out="x", device="cpu", vae_levels=3, patch_size=16)
    with pytest.raises(ValueError, match="--text-tokens must be in"):
        PretrainConfig(out="x", device="cpu", text_tokens=100)
    with pytest.raises(ValueError, match="--lr-schedule must be one of constant, cosine, got 'linear'"):
        PretrainConfig(out="x", device="cpu", lr_schedule="linear")
    with pytest.raises(ValueError, match="--vae-lr-schedule must be one of"):
        PretrainConfig(out="x", device="cpu", vae_lr_schedule="step")
    with pytest.raises(ValueError, match="--zero-tokens must be comma-separated"):
        PretrainConfig(out="x", device="cpu", zero_tokens="32,many")


def test_text_tokens_too_short_for_the_captions_is_refused_before_training(tmp_path):
    cfg = PretrainConfig(out=str(tmp_path / "m"), **TINY, text_tokens=8)
    with pytest.raises(ValueError, match="--text-tokens 8 would cut captions of up to"):
        run(cfg)
    assert not os.path.exists(cfg.out)  # nothing trained or written


@pytest.mark.slow
def test_short_cpu_run_lowers_loss_and_saves_a_loadable_pipeline(tmp_path):
    out = str(tmp_path / "shapes")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    cfg = parse_args(["--out", out, "--steps", "40", "--lr-schedule", "cosine", "--vae-lr-schedule", "cosine", *flags])
    summary = run(cfg)
    assert summary["final_loss"] < 0.8 * summary["first_loss"], summary
    with open(os.path.join(out, "pretrain_summary.json")) as f:
        saved = json.load(f)
    assert saved["steps"] == 40 and saved["device"] == "cpu" and 0 <= saved["eval/accuracy"] <= 1
    assert set(saved) >= {"eval/accuracy/single_object", "eval/reward", "seconds", "safetensors_mb"}

    pipe = StableDiffusion3Pipeline.from_pretrained(out, local_files_only=True)
    assert pipe.vae_scale_factor == 1 and not pipe.text_encoder_3.encoder.final_layer_norm.weight.any()
    assert pipe.vae.config.scaling_factor == pytest.approx(saved["vae_scaling_factor"])
    image = pipe(
        "two red circles",
        num_inference_steps=2,
        guidance_scale=4.5,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images
    assert image.shape == (1, 64, 64, 3)

    adapter = load_adapter(out)  # the SD3 adapter takes it as any SD3 folder
    adapter.check_shape(SampleShape(height=64, width=64))
    encoding = adapter.encode_prompt(["a blue square"], max_sequence_length=32)
    assert encoding["prompt_embeds"].shape == (1, 77 + 32, 32)
