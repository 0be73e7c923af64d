"""References that move and the KL's space: closed forms for the velocity-space KL and its relation to Flow-GRPO's
latent one on an "sde" step, the EMA reference's decay schedule, and what each setting asks of the trainer."""

from __future__ import annotations

import pytest
import torch

from diffrl.algorithms.base import reference_decay_at
from diffrl.algorithms.batches import StepBatch
from diffrl.algorithms.catalog import get_algorithm
from diffrl.algorithms.losses_pg import flow_grpo_loss, kl_per_sample, velocity_kl_per_sample
from diffrl.algorithms.sde import sde_step

D = torch.float64


def test_velocity_kl_is_the_mean_squared_velocity_gap_with_a_constant_reference():
    v = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]], dtype=D, requires_grad=True)
    ref = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.5, -0.5, 1.0, 0.0]], dtype=D, requires_grad=True)
    kl = velocity_kl_per_sample(v.reshape(2, 2, 2), ref.reshape(2, 2, 2))
    torch.testing.assert_close(kl, torch.tensor([(0 + 1 + 4 + 9) / 4, (0.25 + 0.25 + 1) / 4], dtype=D))
    kl.sum().backward()
    torch.testing.assert_close(v.grad, 2 * (v - ref).detach() / 4)  # d/dv mean((v - v_ref)^2)
    assert ref.grad is None  # the reference is a constant of the update
    with pytest.raises(ValueError, match="ref_velocity"):
        velocity_kl_per_sample(v, ref[:, :2])


@pytest.mark.parametrize("eta", [0.3, 0.7, 1.0])
def test_latent_kl_of_an_sde_step_is_the_velocity_kl_times_the_step_factor(eta):
    """For sde_type "sde", mu - mu_ref = (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt (v - v_ref) = (1 + eta^2/2) dt
    (v - v_ref), so the latent KL is the velocity KL times (1 + eta^2/2)^2 dt^2 / (2 std_dev_t^2)."""
    g = torch.Generator().manual_seed(3)
    x, v, v_ref = (torch.randn(3, 4, 2, 2, generator=g, dtype=D) for _ in range(3))
    sigma, sigma_prev = torch.tensor([0.9, 0.6, 0.3], dtype=D), torch.tensor([0.8, 0.45, 0.1], dtype=D)
    step = sde_step(x, v, sigma, sigma_prev, noise_level=eta, noise=torch.zeros_like(x))
    ref = sde_step(x, v_ref, sigma, sigma_prev, noise_level=eta, noise=torch.zeros_like(x))
    dt = (sigma_prev - sigma).reshape(3, 1, 1, 1)
    factor = 1 + eta**2 / 2
    std = eta * torch.sqrt(sigma / (1 - sigma)).reshape(3, 1, 1, 1)
    torch.testing.assert_close(step.std_dev_t, std)
    torch.testing.assert_close(step.prev_sample_mean - ref.prev_sample_mean, factor * dt * (v - v_ref))
    torch.testing.assert_close(step.velocity, v)  # the step hands back the velocity it was taken with
    latent = kl_per_sample(step.prev_sample_mean, ref.prev_sample_mean, step.std_dev_t)
    scale = (factor**2 * dt**2 / (2 * std**2)).reshape(3)
    torch.testing.assert_close(latent, scale * velocity_kl_per_sample(v, v_ref))


def _batch(with_velocity: bool) -> StepBatch:
    g = torch.Generator().manual_seed(0)
    v = torch.randn(4, 3, 2, generator=g, dtype=D)
    old = torch.randn(4, generator=g, dtype=D)
    mean = torch.randn(4, 3, 2, generator=g, dtype=D)
    return StepBatch(
        log_prob=old + 0.01 * torch.randn(4, generator=g, dtype=D),
        old_log_prob=old,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=D),
        prev_sample_mean=mean,
        old_prev_sample_mean=mean + 0.01 * torch.randn(4, 3, 2, generator=g, dtype=D),
        std_dev_t=torch.full((4, 1, 1), 0.4, dtype=D),
        sqrt_dt=torch.full((4, 1, 1), 0.3, dtype=D),
        ref_prev_sample_mean=torch.randn(4, 3, 2, generator=g, dtype=D),
        velocity=v if with_velocity else None,
        ref_velocity=v + 0.1 * torch.randn(4, 3, 2, generator=g, dtype=D) if with_velocity else None,
    )


@pytest.mark.parametrize("name", ["flow_grpo", "grpo_guard", "flow_dppo"])
def test_a_policy_gradient_loss_adds_the_kl_in_the_space_it_names(name):
    batch = _batch(with_velocity=True)
    latent = get_algorithm(name, kl_coef=0.5)
    velocity = get_algorithm(name, kl_coef=0.5, kl_space="velocity")
    loss_latent, m_latent = latent.loss(batch)
    loss_velocity, m_velocity = velocity.loss(batch)
    expected = ((batch.velocity - batch.ref_velocity) ** 2).mean()
    torch.testing.assert_close(m_velocity["actor/kl_loss"], expected)
    torch.testing.assert_close(loss_velocity - 0.5 * expected, loss_latent - 0.5 * m_latent["actor/kl_loss"])
    if name == "flow_grpo":
        pg, _ = flow_grpo_loss(batch.log_prob, batch.old_log_prob, batch.advantages, clip_ratio=1e-4, adv_clip_max=5)
        torch.testing.assert_close(loss_velocity, pg + 0.5 * expected)
    with pytest.raises(ValueError, match="velocity"):
        velocity.loss(_batch(with_velocity=False))


def test_kl_space_is_checked_and_only_policy_gradient_algorithms_have_one():
    with pytest.raises(ValueError, match=r"kl_space must be one of \('latent', 'velocity'\)"):
        get_algorithm("flow_grpo", kl_space="noise")
    with pytest.raises(ValueError, match="kl_space 'velocity' .* needs kl_coef > 0"):
        get_algorithm("flow_grpo_fast", kl_space="velocity")  # kl_coef 0
    for name in ("dpo", "awm", "diffusion_nft", "gardo"):  # their reference penalties have one space of their own
        with pytest.raises(ValueError, match=r"unknown Algorithm field\(s\) \['kl_space'\]"):
            get_algorithm(name, kl_space="velocity")


def test_the_ema_reference_decay_follows_its_schedule():
    assert [reference_decay_at(k, 0.9) for k in (1, 2, 100)] == [0.9, 0.9, 0.9]  # constant
    assert [reference_decay_at(k, 0.3, 0.001) for k in (1, 150, 300, 301, 1000)] == pytest.approx(
        [0.001, 0.15, 0.3, 0.3, 0.3]
    )  # min(ramp * k, decay), Flow-Factory's DGPO ema_ref
    flow_grpo = get_algorithm("flow_grpo", reference="ema", reference_decay=0.5, reference_decay_ramp=0.25)
    assert [flow_grpo.old_adapter_decay(k) for k in (1, 2, 3)] == [0.25, 0.5, 0.5]
    nft = get_algorithm("diffusion_nft", reference="ema")  # the reference is its old policy, with that decay
    assert nft.old_adapter_decay(100) == min(0.001 * 100, 0.5)
    with pytest.raises(NotImplementedError):
        get_algorithm("flow_grpo").old_adapter_decay(1)


def test_an_ema_reference_runs_the_reference_forward_on_the_old_adapter():
    for name in ("flow_grpo", "grpo_guard", "dpo", "awm", "diffusion_nft"):
        decay = {} if name == "diffusion_nft" else {"reference_decay": 0.9}
        frozen, ema = get_algorithm(name).needs, get_algorithm(name, reference="ema", **decay).needs
        assert frozen.reference and not frozen.moving_reference, name
        assert ema.reference and ema.moving_reference and ema.old_adapter, name
        assert ema.samples_with_old_adapter == frozen.samples_with_old_adapter, name  # sampling is unchanged
    assert get_algorithm("flow_dppo", kl_coef=0.01, reference="ema", reference_decay=0.9).needs.moving_reference


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"reference": "initial"}, r"reference must be one of \('frozen', 'ema'\)"),
        ({"reference_decay": 0.9}, "apply only with reference: ema"),
        ({"reference": "ema"}, r"reference_decay must be in \(0, 1\] with reference: ema"),
        ({"reference": "ema", "reference_decay": 1.5}, r"reference_decay must be in \[0, 1\]"),
        ({"reference": "ema", "reference_decay": 0.9, "reference_decay_ramp": -1.0}, "reference_decay_ramp must be"),
        ({"reference": "ema", "reference_decay": 0.9, "kl_coef": 0.0}, "has no reference"),
    ],
)
def test_bad_reference_settings_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        get_algorithm("flow_grpo", **overrides)


def test_an_ema_reference_is_refused_where_the_reference_already_moves_or_is_the_old_adapter():
    with pytest.raises(ValueError, match="'gardo': its reference already moves"):
        get_algorithm("gardo", reference="ema", reference_decay=0.9)
    with pytest.raises(ValueError, match="'dgpo': .*ema_reference: true"):
        get_algorithm("dgpo", reference="ema", reference_decay=0.9)
    with pytest.raises(ValueError, match="old_policy_decay_ramp and old_policy_decay_max set"):
        get_algorithm("diffusion_nft", reference="ema", reference_decay=0.9)
    with pytest.raises(ValueError, match="has no reference"):
        get_algorithm("awm", ref_coef=0.0, reference="ema", reference_decay=0.9)
