"""diffrl.algorithms.sde against closed forms: torch Normal, flow_grpo's formula, diffusers' Euler step."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diffrl.algorithms.sde import sde_step, transition_std

SHAPES = [(2, 6, 4), (2, 3, 4, 4), (2, 2, 3, 4, 4)]  # tokens, images, videos


def _inputs(shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("shape", SHAPES)
def test_sde_matches_flow_grpo_reference_and_normal(shape):
    x, v = _inputs(shape)
    sigma = torch.tensor([0.9, 0.5], dtype=torch.float64)
    sigma_prev = torch.tensor([0.7, 0.3], dtype=torch.float64)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = sde_step(x, v, sigma, sigma_prev, noise_level=0.7, noise=noise)
    view = (-1,) + (1,) * (len(shape) - 1)
    s, sp = sigma.view(view), sigma_prev.view(view)
    dt = sp - s
    std = torch.sqrt(s / (1 - s)) * 0.7
    mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
    sample = mean + std * torch.sqrt(-dt) * noise
    ref_lp = (
        -((sample - mean) ** 2) / (2 * (std * torch.sqrt(-dt)) ** 2)
        - torch.log(std * torch.sqrt(-dt))
        - torch.log(torch.sqrt(torch.as_tensor(2 * math.pi, dtype=torch.float64)))
    )
    normal_lp = torch.distributions.Normal(mean, (std * torch.sqrt(-dt)).expand_as(mean)).log_prob(sample)
    dims = tuple(range(1, len(shape)))
    torch.testing.assert_close(out.prev_sample, sample, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.prev_sample_mean, mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.log_prob, ref_lp.mean(dims), rtol=0, atol=1e-10)
    torch.testing.assert_close(out.log_prob, normal_lp.mean(dims), rtol=0, atol=1e-10)
    assert out.std_dev_t.shape == (2,) + (1,) * (len(shape) - 1)
    torch.testing.assert_close(out.sqrt_dt, torch.sqrt(-dt), rtol=0, atol=1e-15)


def test_sde_sigma_one_uses_sigma_max_and_requires_it():
    x, v = _inputs((2, 3, 4))
    sigma = torch.tensor([1.0, 1.0], dtype=torch.float64)
    sigma_prev = torch.tensor([0.9, 0.9], dtype=torch.float64)
    out = sde_step(x, v, sigma, sigma_prev, noise_level=0.7, noise=torch.zeros_like(x), sigma_max=0.9)
    torch.testing.assert_close(out.std_dev_t.flatten(), torch.full((2,), math.sqrt(1 / 0.1) * 0.7, dtype=torch.float64))
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step(x, v, sigma, sigma_prev, noise_level=0.7, noise=torch.zeros_like(x))
    # an ODE step at sigma == 1 needs no sigma_max
    sde_step(x, v, sigma, sigma_prev, noise_level=0.0)


@pytest.mark.parametrize("shape", SHAPES)
def test_cps_matches_formula(shape):
    x, v = _inputs(shape)
    s, sp, eta = 0.8, 0.6, 0.5
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out = sde_step(x, v, s, sp, noise_level=eta, sde_type="cps", noise=noise)
    std = sp * math.sin(eta * math.pi / 2)
    mean = (x - s * v) * (1 - sp) + (x + (1 - s) * v) * math.sqrt(sp**2 - std**2)
    sample = mean + std * noise
    torch.testing.assert_close(out.prev_sample, sample, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.log_prob, (-((sample - mean) ** 2)).mean(tuple(range(1, len(shape)))))
    torch.testing.assert_close(
        transition_std(out.std_dev_t, out.sqrt_dt, "cps").flatten(), torch.full((2,), std, dtype=torch.float64)
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_dance_sde_matches_formula_and_normal(shape):
    x, v = _inputs(shape)
    s, sp, eta = 0.8, 0.6, 0.3
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = sde_step(x, v, s, sp, noise_level=eta, sde_type="dance_sde", noise=noise)
    x0_hat = x - s * v
    score = -(x - (1 - s) * x0_hat) / s**2
    mean = x + (sp - s) * v - 0.5 * eta**2 * score * (sp - s)
    std = eta * math.sqrt(s - sp)
    sample = mean + std * noise
    normal_lp = torch.distributions.Normal(mean, torch.full_like(mean, std)).log_prob(sample)
    torch.testing.assert_close(out.prev_sample_mean, mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.log_prob, normal_lp.mean(tuple(range(1, len(shape)))), rtol=0, atol=1e-10)


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_noise_level_zero_is_diffusers_euler_step(sde_type):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(6)
    x, v = _inputs((1, 4, 8, 8), dtype=torch.float32)
    for i, t in enumerate(scheduler.timesteps[:-1]):
        expected = scheduler.step(v, t, x, return_dict=False)[0]
        sigma, sigma_prev = scheduler.sigmas[i], scheduler.sigmas[i + 1]
        out = sde_step(
            x,
            v,
            sigma.reshape(1),
            sigma_prev.reshape(1),
            noise_level=0.0,
            sde_type=sde_type,
            sigma_max=scheduler.sigmas[1],
        )
        torch.testing.assert_close(out.prev_sample, expected, rtol=1e-6, atol=1e-6)
        assert torch.all(out.log_prob == 0)


def test_replay_gradient_flows_through_mean_only():
    x, v = _inputs((2, 3, 4))
    v = v.clone().requires_grad_(True)
    stored = torch.randn_like(x).requires_grad_(True)
    out = sde_step(x, v, 0.7, 0.5, noise_level=0.7, prev_sample=stored)
    out.log_prob.sum().backward()
    assert stored.grad is None and v.grad is not None and torch.isfinite(v.grad).all()
    # analytic: d/dv mean(-(x'-mu)^2/(2s^2)) = mean((x'-mu)/s^2 * dmu/dv), dmu/dv = (1 + std^2 (1-s)/(2s)) dt
    s, dt = 0.7, -0.2
    std = math.sqrt(s / (1 - s)) * 0.7
    coef = (1 + std**2 * (1 - s) / (2 * s)) * dt
    expected = (stored.detach() - out.prev_sample_mean.detach()) / (std**2 * -dt) * coef / (3 * 4)
    torch.testing.assert_close(v.grad, expected)


def test_generator_list_is_per_sample_and_batch_independent():
    x, v = _inputs((3, 2, 5))
    gens = lambda: [torch.Generator().manual_seed(s) for s in (10, 11, 12)]  # noqa: E731
    full = sde_step(x, v, 0.6, 0.4, noise_level=0.7, generator=gens())
    alone = sde_step(x[1:2], v[1:2], 0.6, 0.4, noise_level=0.7, generator=[torch.Generator().manual_seed(11)])
    torch.testing.assert_close(full.prev_sample[1:2], alone.prev_sample, rtol=0, atol=0)
    with pytest.raises(ValueError, match="one generator per sample"):
        sde_step(x, v, 0.6, 0.4, noise_level=0.7, generator=gens()[:2])


def test_dtypes_and_errors():
    x, v = _inputs((2, 3, 4), dtype=torch.bfloat16)
    out = sde_step(x, v, 0.6, 0.4, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    assert out.prev_sample.dtype == torch.float32 and out.log_prob.dtype == torch.float32 and out.log_prob.shape == (2,)
    x64, v64 = _inputs((2, 3))
    assert sde_step(x64, v64, 0.6, 0.4, noise_level=0.7).log_prob.dtype == torch.float64
    with pytest.raises(ValueError, match="sde_type"):
        sde_step(x64, v64, 0.6, 0.4, noise_level=0.7, sde_type="ode")
    with pytest.raises(ValueError, match="sigma_prev"):
        sde_step(x64, v64, 0.4, 0.6, noise_level=0.7)
    with pytest.raises(ValueError, match="sigma"):
        sde_step(x64, v64, torch.ones(3), 0.4, noise_level=0.7)


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_device_sigmas_are_never_read_back(sde_type):
    """A replay (or rollout) step with its sigmas on the device reads no value back: on a GPU that read waits for the
    forward queued before it, and the host cannot queue the loss and the backward ahead. No GPU on CI: the meta
    device stands in for it, as reading a meta tensor's value fails where a GPU's would synchronise. The same step
    with host sigmas still checks them."""
    meta = [torch.empty(2, 3, 4, device="meta") for _ in range(3)]
    sigma, sigma_prev = torch.empty(2, device="meta"), torch.empty(2, device="meta")
    out = sde_step(*meta[:2], sigma, sigma_prev, noise_level=0.7, sde_type=sde_type, prev_sample=meta[2])
    assert out.log_prob.device.type == "meta" and out.log_prob.shape == (2,)
    with pytest.raises(ValueError, match="sigma_prev"):
        x, v = _inputs((2, 3, 4))
        sde_step(x, v, torch.tensor([0.4, 0.4]), torch.tensor([0.3, 0.6]), noise_level=0.7, sde_type=sde_type)


@settings(max_examples=30, deadline=None)
@given(
    sde_type=st.sampled_from(["sde", "cps", "dance_sde"]),
    sigma=st.floats(0.05, 0.99),
    frac=st.floats(0.05, 0.95),
    eta=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_replay_log_prob_equals_rollout(sde_type, sigma, frac, eta, seed):
    x, v = _inputs((2, 3, 4), seed=seed % 1000)
    sigma_prev = sigma * frac
    rollout = sde_step(
        x, v, sigma, sigma_prev, noise_level=eta, sde_type=sde_type, generator=torch.Generator().manual_seed(seed)
    )
    replay = sde_step(x, v, sigma, sigma_prev, noise_level=eta, sde_type=sde_type, prev_sample=rollout.prev_sample)
    torch.testing.assert_close(replay.log_prob, rollout.log_prob, rtol=0, atol=1e-9)
