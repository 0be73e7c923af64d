"""Stable Audio 3 adapter on the tiny pipeline ("stable_audio3"): waveform parity with diffusers'
StableAudio3Pipeline at noise level 0 (with and without CFG), the rollout's audio outputs, LoRA, the tiny folder's
size, and the real-size plan's parameter counts."""

from __future__ import annotations

import os

import pytest
import torch
from diffusers import StableAudio3Pipeline
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from diffrl.configs.rollout import SamplingConfig
from diffrl.engines.reward.base import AudioBatch
from diffrl.engines.rollout import RolloutEngine
from diffrl.models.base import SampleShape, load_adapter
from diffrl.models.realsize import meta_counts, plan_for
from diffrl.models.stable_audio3.adapter import StableAudio3Adapter

DURATION = 0.25  # seconds: 2000 samples at the tiny 8 kHz, 125 latent frames
SHAPE = SampleShape(1, 1, duration=DURATION)
PROMPTS = ["a cat sitting on a red chair", "waves on a stormy ocean"]
SEEDS = [3, 11]
# max |diff| <= TOLERANCE x max |reference| (fp32 on the CPU; measured ~2e-6 relative)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("stable_audio3")


@pytest.fixture(scope="module")
def adapter(path):
    return load_adapter(path)


@pytest.fixture(scope="module")
def pipe(path):
    pipe = StableAudio3Pipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _reference(pipe, guidance_scale: float, steps: int) -> torch.Tensor:
    """The pipeline's waveforms (B, 2, T), one call per (prompt, seed) as the rollout's per-sample noise."""
    return torch.cat(
        [
            pipe(p, duration=DURATION, num_inference_steps=steps, guidance_scale=guidance_scale, generator=g).audios
            for p, g in zip(PROMPTS, [torch.Generator().manual_seed(s) for s in SEEDS])
        ]
    )


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])  # the pipeline's default (no CFG), and CFG on
def test_rollout_at_noise_level_0_reproduces_the_pipelines_waveforms(adapter, pipe, guidance_scale):
    steps = 4
    expected = _reference(pipe, guidance_scale, steps)
    cfg = SamplingConfig(
        num_inference_steps=steps, duration=DURATION, guidance_scale=guidance_scale, noise_level=0.0, batch_size=2
    )
    traj = RolloutEngine(adapter, progress=False).generate(PROMPTS, ["a", "b"], [0, 0], SEEDS, cfg)
    assert traj.audio.shape == expected.shape == (2, 2, int(DURATION * 8000)) and traj.sample_rate == 8000
    assert traj.images.shape == (2, 0, 0, 3)  # audio only: no frames
    assert float(expected.abs().max()) > 0.1  # audible, not silence: the comparison means something
    assert float((traj.audio - expected).abs().max()) <= TOLERANCE * float(expected.abs().max())
    assert float((expected[0] - expected[1]).abs().max()) > 0.1  # prompts and seeds change the audio
    outputs = traj.outputs
    assert isinstance(outputs, AudioBatch) and outputs.video is None and outputs.sample_rate == 8000


def test_sigmas_are_the_pipelines_log_snr_schedule(adapter, pipe):
    sigmas = adapter.sigmas(8, SHAPE)
    from diffusers.pipelines.stable_audio_3.pipeline_stable_audio_3 import logsnr_sigma_schedule

    expected = torch.sigmoid(-(2.0 - torch.linspace(1.0, 0.0, 9) * (2.0 + 6.2)))  # sigmoid(-logsnr)
    expected[0], expected[-1] = 1.0, 0.0
    assert torch.allclose(sigmas, expected, atol=1e-6)
    assert sigmas[:-1].tolist() == pytest.approx(logsnr_sigma_schedule(8, -6.2, 2.0), abs=1e-7)


def test_shapes_and_errors(adapter):
    latents = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(0)])
    assert latents.shape == (1, 8, 125)  # ceil(0.25 s x 8000 / 16)
    assert adapter.duration(SampleShape(1, 1)) == 10.0  # the pipeline's default
    with pytest.raises(ValueError, match="duration"):
        adapter.check_shape(SampleShape(1, 1, duration=0.0))
    with pytest.raises(ValueError, match="audio only"):
        adapter.decode(latents, SHAPE)
    assert StableAudio3Adapter.has_audio and not StableAudio3Adapter.visual


def test_lora_gets_gradients_and_its_file_loads_back(path, tmp_path):
    adapter = load_adapter(path)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(adapter.default_lora_targets))
    adapter.transformer.add_adapter(config)
    for name, p in adapter.transformer.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    enc = adapter.encode_prompt(PROMPTS[:1])
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(0)])
    v = adapter.velocity(x, torch.tensor([0.5]), enc, None, guidance_scale=1.0, shape=SHAPE)
    v.square().mean().backward()
    grads = [p.grad for n, p in adapter.transformer.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    # the checkpoint's LoRA file (the pipeline's save_lora_weights) loads into a fresh transformer: same velocity
    layers = get_peft_model_state_dict(adapter.transformer)
    type(adapter.pipe).save_lora_weights(
        str(tmp_path), transformer_lora_layers=layers, transformer_lora_adapter_metadata=config.to_dict()
    )
    fresh = load_adapter(path)
    fresh.transformer.load_lora_adapter(
        str(tmp_path), prefix="transformer", weight_name="pytorch_lora_weights.safetensors"
    )
    with torch.no_grad():
        again = fresh.velocity(x, torch.tensor([0.5]), enc, None, guidance_scale=1.0, shape=SHAPE)
    assert torch.allclose(again, v.detach(), atol=1e-5) and not torch.allclose(again, torch.zeros_like(again))


def test_the_tiny_folder_is_under_one_megabyte(path):
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    assert size < 1_000_000, size


def test_real_size_plan_counts():
    counts = {name: params for name, (params, _) in meta_counts(plan_for("stable_audio3_medium")).items()}
    # T5Gemma B's encoder: 256000 x 768 embedding + 12 Gemma 2 layers (4 x 768² attention, 3 x 768 x 2048 MLP, 4
    # norms) + the final norm; with the decoder this is keras-hub's 591,490,560 for t5gemma_b_b_ul2
    assert counts["text_encoder"] == 256000 * 768 + 12 * (4 * 768**2 + 3 * 768 * 2048 + 4 * 768) + 768
    assert round(counts["vae"] / 1e6) == 852  # "SAME-L (852 M params, used by SA3 Medium)", AutoencoderSAME's doc
    assert counts["duration_embedder"] == 256 * 768 + 768
