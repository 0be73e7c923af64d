"""The vLLM-Omni diffusion backend at its seams (diffrl/engines/rollout/vllm_omni.py). vllm-omni has
no CPU platform, so nothing here starts it: the worker side is a stand-in loop written in the test (the denoising loop
vLLM-Omni's RL pipelines run, with a closed-form velocity field instead of a transformer), fed by the real diffusers
schedule. Checked: the SDE step vLLM-Omni's scheduler takes (sigma = sigmas[i], sigma_prev = sigmas[i + 1],
sigma_max = sigmas[1]) equals the published Flow-GRPO / CPS formulas and diffrl's sde_step; the request pins diffrl's
window and is JSON; the answer maps to diffrl's layout and replays to its own log-probs with diffrl's sampler."""

from __future__ import annotations

import json
import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from diffrl.algorithms.sde import sde_step
from diffrl.engines.rollout.vllm_omni import OmniChunk, lora_request, omni_request, omni_sde_step, rollout_from_omni

STEPS = 6


def _schedule() -> torch.Tensor:
    """(STEPS + 1,) descending sigmas from 1.0 to 0, as vLLM-Omni's SD3-style scheduler makes them (shift 3)."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(STEPS)
    return scheduler.sigmas.double()


def _velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    return -0.7 * x + 0.3 * sigma  # a smooth stand-in for the transformer's prediction


def _published(x, v, sigma, sigma_prev, sigma_max, eta, sde_type, prev):
    """Flow-GRPO's reverse SDE step (arXiv:2505.05470 eq. 9 with its Gaussian density) and CPS (arXiv:2509.05952),
    log-density averaged over the non-batch dims as both reference codes do."""
    dt = sigma_prev - sigma
    if sde_type == "sde":
        std = eta * math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma)))
        mean = x * (1 + std**2 / (2 * sigma) * dt) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
        scale = std * math.sqrt(-dt)
        log_prob = -((prev - mean) ** 2) / (2 * scale**2) - math.log(scale) - 0.5 * math.log(2 * math.pi)
    else:
        std = sigma_prev * math.sin(eta * math.pi / 2)
        mean = (x - sigma * v) * (1 - sigma_prev) + (x + (1 - sigma) * v) * math.sqrt(sigma_prev**2 - std**2)
        log_prob = -((prev - mean) ** 2)
    return mean, log_prob.mean(dim=tuple(range(1, x.ndim)))


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_the_omni_step_is_the_published_step_and_diffrls(sde_type):
    sigmas = _schedule()
    assert float(sigmas[0]) == 1.0  # step 0 exercises the sigma == 1 rule (sigma_max = sigmas[1])
    gen = torch.Generator().manual_seed(0)
    for i in range(STEPS - 1):  # the last step ends at sigma 0: never in a window (CPS's std would be 0)
        x = torch.randn(3, 4, 8, generator=gen, dtype=torch.float64)
        v = _velocity(x, float(sigmas[i]))
        prev = x + torch.randn(3, 4, 8, generator=gen, dtype=torch.float64) * 0.1
        step = omni_sde_step(x, v, sigmas, i, noise_level=0.7, sde_type=sde_type, prev_sample=prev)
        mean, log_prob = _published(x, v, float(sigmas[i]), float(sigmas[i + 1]), float(sigmas[1]), 0.7, sde_type, prev)
        torch.testing.assert_close(step.prev_sample_mean, mean, rtol=0, atol=1e-12)
        torch.testing.assert_close(step.log_prob, log_prob, rtol=0, atol=1e-10)
        direct = sde_step(
            x,
            v,
            sigmas[i],
            sigmas[i + 1],
            noise_level=0.7,
            sde_type=sde_type,
            prev_sample=prev,
            sigma_max=float(sigmas[1]),
        )
        assert torch.equal(direct.log_prob, step.log_prob)
    with pytest.raises(ValueError, match="sde_type"):
        omni_sde_step(x, v, sigmas, 0, noise_level=0.7, sde_type="dance_sde")


def test_the_request_pins_diffrls_window():
    chunk = OmniChunk(prompt_ids=[5, 6, 7], negative_prompt_ids=[1], seeds=[42, 42], window_start=2, window_size=3)
    body = omni_request(
        chunk, height=64, width=32, num_inference_steps=STEPS, guidance_scale=4.0, noise_level=0.7, sde_type="sde"
    )
    assert json.loads(json.dumps(body)) == body  # plain JSON: nothing pickled crosses the process boundary
    prompt, params = body["prompt"], body["sampling_params"]
    assert prompt == {
        "prompt_token_ids": [5, 6, 7],
        "prompt_mask": [1, 1, 1],
        "negative_prompt_ids": [1],
        "negative_prompt_mask": [1],
    }
    assert (params["height"], params["width"], params["seed"], params["num_outputs_per_prompt"]) == (64, 32, 42, 2)
    extra = params["extra_args"]
    assert extra["sde_window_size"] == 3 and extra["logprobs"] is True and extra["noise_level"] == 0.7
    low, high = extra["sde_window_range"]
    assert list(range(low, high - extra["sde_window_size"] + 1)) == [2]  # vLLM-Omni's start draw has one choice
    with pytest.raises(ValueError, match="does not fit"):
        omni_request(
            OmniChunk([1], None, [0], 4, 3),
            height=8,
            width=8,
            num_inference_steps=STEPS,
            guidance_scale=1.0,
            noise_level=0.7,
            sde_type="sde",
        )
    with pytest.raises(ValueError, match="one seed"):
        omni_request(
            OmniChunk([1], None, [0, 1], 0, 2),
            height=8,
            width=8,
            num_inference_steps=STEPS,
            guidance_scale=1.0,
            noise_level=0.7,
            sde_type="sde",
        )
    assert lora_request(3, "/w/v3") == {"lora_name": "policy-v3", "lora_int_id": 4, "lora_path": "/w/v3"}


def _omni_worker(x: torch.Tensor, sigmas: torch.Tensor, window: tuple[int, int], seed: int) -> dict:
    """Stand-in for vLLM-Omni's RL pipeline loop: every step of the schedule, noise only inside the window, the
    latent entering the window and each window step's output kept with its log-prob and timestep (sigma * 1000)."""
    gen = torch.Generator().manual_seed(seed)
    latents, log_probs, timesteps = [], [], []
    for i in range(STEPS):
        inside = window[0] <= i < window[1]
        if i == window[0]:
            latents.append(x.float())
        step = omni_sde_step(
            x, _velocity(x, float(sigmas[i])), sigmas, i, noise_level=0.7 if inside else 0.0, generator=gen
        )
        x = step.prev_sample
        if inside:
            latents.append(x.float())
            log_probs.append(step.log_prob)
            timesteps.append(sigmas[i] * 1000)
    b = x.shape[0]
    return {
        "all_latents": torch.stack(latents, dim=1),
        "all_log_probs": torch.stack(log_probs, dim=1),
        "all_timesteps": torch.stack(timesteps).float().unsqueeze(0).expand(b, -1),
    }


def test_the_answer_maps_to_trajectories_and_replays():
    sigmas = _schedule()
    noise = torch.randn(2, 16, 4, generator=torch.Generator().manual_seed(1))
    out = _omni_worker(noise, sigmas, (1, 4), seed=7)
    rollout = rollout_from_omni(out, sigmas)
    assert rollout.window_starts.tolist() == [1, 1] and rollout.latents.shape == (2, 4, 16, 4)
    torch.testing.assert_close(rollout.sigmas[0], sigmas[1:4].float())
    torch.testing.assert_close(rollout.sigmas_prev[0], sigmas[2:5].float())
    for j in range(3):  # diffrl's trainer replays each stored step to the log-prob vLLM-Omni reported
        x = rollout.latents[:, j]
        replay = sde_step(
            x,
            _velocity(x, float(rollout.sigmas[0, j])),
            rollout.sigmas[:, j],
            rollout.sigmas_prev[:, j],
            noise_level=0.7,
            prev_sample=rollout.latents[:, j + 1],
            sigma_max=float(sigmas[1]),
        )
        torch.testing.assert_close(replay.log_prob, rollout.log_probs[:, j], rtol=0, atol=1e-4)
    shifted = dict(out, all_timesteps=out["all_timesteps"] * 0.99)  # a worker on another schedule
    with pytest.raises(ValueError, match="not a run of the schedule"):
        rollout_from_omni(shifted, sigmas)
    with pytest.raises(ValueError, match="logprobs=true"):
        rollout_from_omni(dict(out, all_log_probs=None), sigmas)
