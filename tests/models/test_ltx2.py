"""LTX-2 adapter on the tiny "ltx2" pipeline: parity of both streams with diffusers' LTX2Pipeline at noise level 0, the
packed log-prob against the two streams' own, shapes, refusals."""

from __future__ import annotations

import pytest
import torch
from diffusers import LTX2Pipeline

from diffrl.algorithms.sde import sde_step
from diffrl.models.base import SampleShape, load_adapter
from diffrl.models.ltx2.adapter import LTX2Adapter

SHAPE = SampleShape(64, 64, num_frames=9)  # 2 x 2 x 2 video tokens, 9 latent audio frames (0.375 s at 24 fps)
MAX_LEN = 32  # a multiple of the tiny connectors' 8 registers
AUDIO_RTOL = 1e-3  # audio parity: max |diff| <= AUDIO_RTOL x max |ref|
# upstream's call defaults turn on STG and modality guidance, which the adapter does not implement
NO_STG = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0)
NO_STG["spatio_temporal_guidance_blocks"] = None


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("ltx2")


@pytest.fixture(scope="module")
def adapter(path):
    return LTX2Adapter.from_pretrained(path, audio_guidance_scale=5.0, guidance_rescale=0.7)


@pytest.fixture(scope="module")
def pipe(path):
    pipe = LTX2Pipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_outputs(pipe, prompt, seed, *, guidance_scale, audio_guidance_scale, rescale, negative=""):
    """The pipeline's uint8 frames (1, F, H, W, 3) and waveform (1, C, T) for one prompt and seed."""
    out = pipe(
        prompt=prompt,
        negative_prompt=negative,
        height=SHAPE.height,
        width=SHAPE.width,
        num_frames=SHAPE.num_frames,
        frame_rate=24.0,
        num_inference_steps=4,
        guidance_scale=guidance_scale,
        audio_guidance_scale=audio_guidance_scale,
        guidance_rescale=rescale,
        audio_guidance_rescale=rescale,
        max_sequence_length=MAX_LEN,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
        **NO_STG,
    )
    return torch.from_numpy((out.frames * 255).round().astype("uint8")), out.audio.float()


def euler(adapter, prompts, seeds, *, guidance_scale, negative=""):
    """Noise-level-0 sampling through the adapter contract: the final packed latents."""
    enc = adapter.encode_prompt(prompts, max_sequence_length=MAX_LEN)
    neg = adapter.encode_prompt([negative] * len(prompts), max_sequence_length=MAX_LEN)
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(s) for s in seeds])
    sigmas = adapter.sigmas(4, SHAPE)
    with torch.no_grad():
        for i in range(4):
            v = adapter.velocity(
                x, sigmas[i].expand(len(prompts)), enc, neg, guidance_scale=guidance_scale, shape=SHAPE
            )
            x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


def test_batch_with_both_guidance_scales_matches_pipeline(adapter, pipe):
    prompts, seeds = ["a red ball rolls to the left", "the sun sets over the sea"], [7, 11]
    x = euler(adapter, prompts, seeds, guidance_scale=3.0, negative="blurry")
    video, audio = adapter.decode(x, SHAPE), adapter.decode_audio(x, SHAPE)
    assert video.shape == (2, 9, 64, 64, 3) and video.dtype == torch.uint8
    assert audio.shape == (2, 2, 2656) and audio.dtype == torch.float32  # 33 mel frames x 80 = 0.33 s at 8 kHz
    for i in range(2):
        ref_video, ref_audio = pipeline_outputs(
            pipe, prompts[i], seeds[i], guidance_scale=3.0, audio_guidance_scale=5.0, rescale=0.7, negative="blurry"
        )
        assert int((video[i].int() - ref_video[0].int()).abs().max()) <= 1
        assert (audio[i] - ref_audio[0]).abs().max() <= AUDIO_RTOL * ref_audio.abs().max()
    # the guidance is visible in both streams, so the parity above tests it
    plain_video, plain_audio = pipeline_outputs(
        pipe, prompts[1], seeds[1], guidance_scale=1.0, audio_guidance_scale=1.0, rescale=0.0, negative="blurry"
    )
    assert (plain_video.float() - ref_video.float()).abs().mean() > 5
    assert (plain_audio - ref_audio).abs().max() > 0.05 * ref_audio.abs().max()
    assert ref_audio.std() > 0.05 and ref_video.float().std() > 10  # real signals, not constants


def test_packed_log_prob_is_the_element_weighted_mean_of_the_streams(adapter):
    n_video, n_audio = adapter.stream_sizes(SHAPE)
    assert (n_video, n_audio) == (2 * 2 * 2 * 4, 9 * 2 * 2)
    generator = torch.Generator().manual_seed(0)
    x, v, noise = (torch.randn(3, n_video + n_audio, generator=generator) for _ in range(3))
    sigma, sigma_prev = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.7, 0.4, 0.1])
    for sde_type in ("sde", "dance_sde"):
        step = dict(noise_level=0.8, sde_type=sde_type, sigma_max=0.95)
        packed = sde_step(x, v, sigma, sigma_prev, noise=noise, **step).log_prob
        streams = [
            sde_step(xs, vs, sigma, sigma_prev, noise=ns, **step).log_prob
            for xs, vs, ns in zip(adapter.split(x, SHAPE), adapter.split(v, SHAPE), adapter.split(noise, SHAPE))
        ]
        combined = (n_video * streams[0] + n_audio * streams[1]) / (n_video + n_audio)
        torch.testing.assert_close(packed, combined, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(streams[0], streams[1])  # the weights matter


def test_layout_knobs_and_refusals(adapter, path):
    x = adapter.prepare_latents(SHAPE, [torch.Generator().manual_seed(3)])
    video, audio = adapter.split(x, SHAPE)
    assert video.shape == (1, 8, 4) and audio.shape == (1, 9, 4)
    assert torch.equal(adapter.pack(video, audio), x)
    assert adapter.fps == 24.0 and adapter.audio_sample_rate == 8000 and adapter.has_audio and adapter.is_video
    # LTX-2's real compression: 32 pixels, 8 frames a latent; the schedule is stretched to end at 0.1
    sigmas = adapter.sigmas(4, SHAPE)
    assert sigmas[0] == 1 and sigmas[-1] == 0 and sigmas[-2] == pytest.approx(0.1)
    assert adapter.needs_negative(1.0)  # the audio scale (5.0) alone turns CFG on
    for bad, name in ((SampleShape(48, 64, 9), "height"), (SampleShape(64, 64, 8), "num_frames")):
        with pytest.raises(ValueError, match=name):
            adapter.check_shape(bad)
    with pytest.raises(ValueError, match="registers"):
        adapter.encode_prompt(["a cat"], max_sequence_length=20)
    with pytest.raises(ValueError, match="not supported"):
        load_adapter(path, stg_scale=1.0)
    with pytest.raises(ValueError, match="latents"):
        adapter.split(x[:, :-1], SHAPE)
    slow = LTX2Adapter(adapter.pipe, frame_rate=12.0)  # twice as long a clip: round(0.75 s x 25) latent audio frames
    assert slow.stream_sizes(SHAPE)[1] == 19 * 2 * 2
