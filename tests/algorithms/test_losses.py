"""diffrl.algorithms.losses against hand-written published formulas and analytic gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from diffrl.algorithms.losses import (
    awm_loss,
    diffusion_nft_loss,
    distillation_loss,
    dpo_loss,
    flow_dppo_loss,
    flow_grpo_loss,
    grpo_guard_loss,
    kl_loss,
)

D = torch.float64


def _lp(seed=0, b=6):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(b, generator=g, dtype=D)
    new = old + 0.3 * torch.randn(b, generator=g, dtype=D)
    adv = 4 * torch.randn(b, generator=g, dtype=D)
    return new, old, adv


def test_flow_grpo_loss_value_metrics_and_gradient():
    new, old, adv = _lp()
    new = new.clone().requires_grad_(True)
    weights = torch.linspace(0.5, 1.5, 6, dtype=D)
    loss, m = flow_grpo_loss(new, old, adv, clip_ratio=0.2, adv_clip_max=5.0, weights=weights)
    a = adv.clamp(-5, 5)
    r = torch.exp(new.detach() - old)
    per = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
    torch.testing.assert_close(loss.detach(), (per * weights).mean())
    loss.backward()
    # d/dlp of max(...): -A r where the unclipped branch is active (or both equal), else 0
    active = (-a * r) >= (-a * r.clamp(0.8, 1.2))
    torch.testing.assert_close(new.grad, torch.where(active, -a * r * weights / 6, torch.zeros_like(r)))
    torch.testing.assert_close(m["actor/pg_clipfrac"], ((r - 1).abs() > 0.2).to(D).mean())
    torch.testing.assert_close(m["actor/ppo_kl"], (old - new.detach()).mean())
    assert set(m) >= {
        "actor/pg_loss",
        "actor/pg_clipfrac_higher",
        "actor/pg_clipfrac_lower",
        "actor/ratio_mean",
        "actor/ratio_std",
    }


def test_kl_loss_scaled_form_vs_exact_gaussian_kl():
    g = torch.Generator().manual_seed(1)
    mu, ref = torch.randn(3, 4, 5, generator=g, dtype=D), torch.randn(3, 4, 5, generator=g, dtype=D)
    std = torch.tensor([0.5, 1.0, 2.0], dtype=D).view(3, 1, 1)
    expected = (((mu - ref) ** 2).mean((1, 2)) / (2 * std.flatten() ** 2)).mean()
    torch.testing.assert_close(kl_loss(mu, ref, std), expected)
    # exact KL of the "sde" transitions (std * sqrt_dt) is kl_loss / dt
    dt = 0.2
    p = torch.distributions.Normal(mu, (std * dt**0.5).expand_as(mu))
    q = torch.distributions.Normal(ref, (std * dt**0.5).expand_as(ref))
    exact = torch.distributions.kl_divergence(p, q).mean((1, 2)).mean()
    torch.testing.assert_close(kl_loss(mu, ref, std) / dt, exact)


def test_distillation_loss_is_the_reverse_kl_to_the_teacher_and_its_ode_surrogate():
    """DiffusionOPD: per sample the exact KL(student || teacher) of two Gaussians sharing the student's std (torch's
    own kl_divergence), 1/2 the mean squared gap where the std is 0 (an ODE step), plus fm_coef x the velocity MSE."""
    g = torch.Generator().manual_seed(2)
    mu, teacher = torch.randn(3, 4, 5, generator=g, dtype=D), torch.randn(3, 4, 5, generator=g, dtype=D)
    v, v_teacher = torch.randn(3, 4, 5, generator=g, dtype=D), torch.randn(3, 4, 5, generator=g, dtype=D)
    std = torch.tensor([0.5, 2.0, 0.0], dtype=D).view(3, 1, 1)
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=D)
    mu = mu.clone().requires_grad_(True)
    loss, m = distillation_loss(
        mu, teacher, std, velocity=v, teacher_velocity=v_teacher, kl_coef=2.0, fm_coef=0.5, weights=weights
    )
    sde = torch.distributions.Normal(mu.detach()[:2], std[:2].expand(2, 4, 5))
    exact = torch.distributions.kl_divergence(sde, torch.distributions.Normal(teacher[:2], std[:2].expand(2, 4, 5)))
    kl = torch.cat([exact.mean((1, 2)), ((mu.detach()[2] - teacher[2]) ** 2).mean().view(1) / 2])
    fm = ((v - v_teacher) ** 2).mean((1, 2))
    torch.testing.assert_close(loss.detach(), (weights * (2.0 * kl + 0.5 * fm)).mean())
    torch.testing.assert_close(m["actor/distill_kl_loss"], (weights * kl).mean())
    torch.testing.assert_close(m["actor/distill_fm_mse_loss"], (weights * fm).mean())
    loss.backward()  # d/dmu: 2 x weight x (mu - teacher) / (std^2 or 1) / (20 elements x 3 samples)
    scale = torch.where(std == 0, torch.ones_like(std), std) ** 2
    torch.testing.assert_close(mu.grad, 2.0 * weights.view(3, 1, 1) * (mu.detach() - teacher) / scale / 60)
    # the teacher's mean is a constant of the update; a student at the teacher pays nothing
    assert distillation_loss(teacher, teacher, std)[0].item() == 0.0


def test_grpo_guard_per_sample_formula():
    new, old, adv = _lp(2)
    g = torch.Generator().manual_seed(3)
    mu, mu_old = torch.randn(6, 8, generator=g, dtype=D), torch.randn(6, 8, generator=g, dtype=D)
    std = torch.rand(6, 1, generator=g, dtype=D) + 0.5
    sqrt_dt = torch.rand(6, 1, generator=g, dtype=D) * 0.3 + 0.1
    loss, m = grpo_guard_loss(
        new,
        old,
        adv,
        prev_sample_mean=mu,
        old_prev_sample_mean=mu_old,
        std_dev_t=std,
        sqrt_dt=sqrt_dt,
        clip_ratio=0.1,
        adv_clip_max=5.0,
    )
    s = (std * sqrt_dt).flatten()
    ratio = torch.exp((new - old + ((mu - mu_old) ** 2).mean(1) / (2 * s**2)) * s)
    a = adv.clamp(-5, 5)
    per = torch.maximum(-a * ratio, -a * ratio.clamp(0.9, 1.1)) / sqrt_dt.flatten() ** 2
    torch.testing.assert_close(loss, per.mean())
    torch.testing.assert_close(m["actor/ratio_mean"], ratio.mean())
    # shared timestep: equals the published batch-mean form
    loss_shared, _ = grpo_guard_loss(
        new,
        old,
        adv,
        prev_sample_mean=mu,
        old_prev_sample_mean=mu_old,
        std_dev_t=0.8,
        sqrt_dt=0.2,
        clip_ratio=0.1,
        adv_clip_max=5.0,
    )
    s = 0.8 * 0.2
    ratio = torch.exp((new - old + ((mu - mu_old) ** 2).mean(1) / (2 * s**2)) * s)
    torch.testing.assert_close(loss_shared, torch.maximum(-a * ratio, -a * ratio.clamp(0.9, 1.1)).mean() / 0.04)


def test_flow_dppo_mask():
    old = torch.zeros(4, dtype=D)
    new = torch.tensor([0.1, 0.1, -0.1, -0.1], dtype=D)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=D)
    mu_old = torch.zeros(4, 3, dtype=D)
    mu = torch.tensor([[1.0] * 3, [1.0] * 3, [1.0] * 3, [0.0] * 3], dtype=D)
    loss, m = flow_dppo_loss(
        new, old, adv, prev_sample_mean=mu, old_prev_sample_mean=mu_old, std_dev_t=1.0, sqrt_dt=1.0, kl_threshold=0.1
    )
    # KL = 0.5 for samples 0-2, 0 for 3; sample 0 (r>1, A>0) and 2 (r<1, A<0) are dropped
    r = torch.exp(new)
    expected = torch.stack([torch.zeros((), dtype=D), -adv[1] * r[1], torch.zeros((), dtype=D), -adv[3] * r[3]]).mean()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(m["actor/dppo_masked_frac"], torch.tensor(0.5, dtype=D))
    torch.testing.assert_close(m["actor/dppo_kl_mean"], torch.tensor(0.375, dtype=D))


def test_dpo_loss_formula_and_metrics():
    g = torch.Generator().manual_seed(4)
    ew, el, rw, rl = (torch.rand(5, generator=g, dtype=D) for _ in range(4))
    loss, m = dpo_loss(ew, el, rw, rl, beta=10.0)
    inside = -0.5 * 10.0 * ((ew - rw) - (el - rl))
    torch.testing.assert_close(loss, -F.logsigmoid(inside).mean())
    torch.testing.assert_close(m["actor/implicit_acc"], (inside > 0).to(D).mean())
    torch.testing.assert_close(m["rewards/margins"], m["rewards/chosen"] - m["rewards/rejected"])


def _nft_inputs(seed=5, shape=(3, 2, 4)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=D) for _ in range(5)]


def test_diffusion_nft_loss_formula():
    v, v_old, v_ref, x0, noise = _nft_inputs()
    sigma = torch.tensor([0.2, 0.5, 0.9], dtype=D)
    s = sigma.view(3, 1, 1)
    x_t = (1 - s) * x0 + s * noise
    adv = torch.tensor([7.0, -1.0, 0.5], dtype=D)
    beta, m_clip = 0.7, 5.0
    loss, m = diffusion_nft_loss(
        v, v_old, x_t, x0, sigma, adv, adv_clip_max=m_clip, mix_beta=beta, ref_velocity=v_ref, ref_coef=0.01
    )
    r = ((adv.clamp(-5, 5) / 5) / 2 + 0.5).clamp(0, 1)
    pos_x0 = x_t - s * (beta * v + (1 - beta) * v_old)
    neg_x0 = x_t - s * ((1 + beta) * v_old - beta * v)
    pos = ((pos_x0 - x0) ** 2).mean((1, 2)) / (pos_x0 - x0).abs().mean((1, 2))
    neg = ((neg_x0 - x0) ** 2).mean((1, 2)) / (neg_x0 - x0).abs().mean((1, 2))
    policy = (m_clip * (r * pos + (1 - r) * neg) / beta).mean()
    torch.testing.assert_close(loss, policy + 0.01 * ((v - v_ref) ** 2).mean())
    torch.testing.assert_close(m["actor/old_deviate"], ((v - v_old) ** 2).mean())
    assert set(m) >= {"actor/positive_loss", "actor/negative_loss", "actor/old_deviate"}


def test_diffusion_nft_gradient_points_to_positive_samples():
    # r = 1 (A >= adv_clip_max), beta = 1: loss = m * mean((x_t - s v - x0)^2) / sg(.) -> pulls v to the target
    v, v_old, _, x0, noise = _nft_inputs(6)
    s = torch.full((3,), 0.5, dtype=D)
    x_t = 0.5 * x0 + 0.5 * noise
    v = v.clone().requires_grad_(True)
    loss, _ = diffusion_nft_loss(v, v_old, x_t, x0, s, torch.full((3,), 9.0, dtype=D), adv_clip_max=5.0)
    loss.backward()
    err = x_t - 0.5 * v.detach() - x0
    weight = err.abs().mean((1, 2), keepdim=True)
    torch.testing.assert_close(v.grad, 5.0 * (2 * err * -0.5) / weight / 8 / 3)


def test_awm_loss_formula_and_gradient():
    v, _, v_ref, x0, noise = _nft_inputs(7)
    target = noise - x0
    sigma = torch.tensor([0.2, 0.5, 0.9], dtype=D)
    adv = torch.tensor([2.0, -8.0, 0.5], dtype=D)
    v = v.clone().requires_grad_(True)
    loss, m = awm_loss(v, target, sigma, adv, adv_clip_max=5.0, ref_velocity=v_ref, ref_coef=0.1, weighting="t")
    a = adv.clamp(-5, 5)
    fm = sigma * ((v.detach() - target) ** 2).mean((1, 2))
    torch.testing.assert_close(loss.detach(), (a * fm).mean() + 0.1 * ((v.detach() - v_ref) ** 2).mean())
    loss.backward()
    expected = (a * sigma).view(3, 1, 1) * 2 * (v.detach() - target) / 8 / 3 + 0.1 * 2 * (v.detach() - v_ref) / 24
    torch.testing.assert_close(v.grad, expected)
    with pytest.raises(ValueError, match="weighting"):
        awm_loss(v, target, sigma, adv, adv_clip_max=5.0, weighting="huber")


def test_errors_and_dtypes():
    new, old, adv = _lp()
    with pytest.raises(ValueError, match="clip_ratio"):
        flow_grpo_loss(new, old, adv, clip_ratio=0.0, adv_clip_max=5.0)
    with pytest.raises(ValueError, match="advantages"):
        flow_grpo_loss(new, old, adv[:3], clip_ratio=0.1, adv_clip_max=5.0)
    loss, _ = flow_grpo_loss(new.float(), old.float(), adv.float(), clip_ratio=0.1, adv_clip_max=5.0)
    assert loss.dtype == torch.float32


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), clip=st.floats(1e-5, 0.5))
def test_flow_grpo_on_policy_gradient_is_reinforce(seed, clip):
    # at ratio == 1 no sample is clipped: d loss / d lp = -A / B
    _, old, adv = _lp(seed)
    new = old.clone().requires_grad_(True)
    loss, m = flow_grpo_loss(new, old, adv, clip_ratio=clip, adv_clip_max=5.0)
    loss.backward()
    torch.testing.assert_close(new.grad, -adv.clamp(-5, 5) / 6)
    assert float(m["actor/pg_clipfrac"]) == 0.0
