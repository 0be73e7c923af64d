"""SFT's math: the supervised flow-matching loss and its timestep densities, against closed forms."""

from __future__ import annotations

import pytest
import torch

from diffrl.algorithms.losses_dp import sft_loss
from diffrl.algorithms.sft import draw_training_sigma

D = torch.float64


def test_sft_loss_is_the_mean_squared_velocity_error_with_its_gradient():
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=D, requires_grad=True)
    target = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=D)
    loss, metrics = sft_loss(v, target)
    assert loss.item() == 4.5  # per sample (1 + 4) / 2 = 2.5 and (4 + 9) / 2 = 6.5
    assert metrics["actor/fm_loss"].item() == 4.5
    loss.backward()
    torch.testing.assert_close(v.grad, 2 * (v.detach() - target) / 4)  # d/dv of the mean over b x d = 4 entries
    with pytest.raises(ValueError, match="target"):
        sft_loss(v, target[:, :1])


def test_the_exact_velocity_of_a_one_image_dataset_has_zero_loss():
    """For data x0 alone, x_t = (1 - s) x0 + s noise determines noise: v* = (x_t - x0) / s = noise - x0."""
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(4, 2, 3, generator=g, dtype=D), torch.randn(4, 2, 3, generator=g, dtype=D)
    s = torch.tensor([0.1, 0.4, 0.7, 0.95], dtype=D).view(4, 1, 1)
    x_t = (1 - s) * x0 + s * noise
    loss, _ = sft_loss((x_t - x0) / s, noise - x0)
    assert loss.item() == pytest.approx(0.0, abs=1e-24)
    assert sft_loss(torch.zeros_like(x0), noise - x0)[0].item() == pytest.approx(((noise - x0) ** 2).mean().item())


def test_timestep_densities():
    """logit_normal: sigmoid(m + s z), z the generator's next normal (SD3's rf/lognorm(m, s)); uniform: U(0, 1)."""
    for m, s in ((0.0, 1.0), (0.5, 0.3)):
        drawn = draw_training_sigma(torch.Generator().manual_seed(3), "logit_normal", m, s)
        assert drawn == torch.sigmoid(m + s * torch.randn((), generator=torch.Generator().manual_seed(3)))
    assert draw_training_sigma(torch.Generator().manual_seed(3), "uniform") == torch.rand(
        (), generator=torch.Generator().manual_seed(3)
    )
    gen = torch.Generator().manual_seed(0)
    logits = torch.logit(torch.stack([draw_training_sigma(gen, "logit_normal", 0.5, 0.3) for _ in range(4000)]))
    assert logits.mean().item() == pytest.approx(0.5, abs=0.02) and logits.std().item() == pytest.approx(0.3, abs=0.02)
    with pytest.raises(ValueError, match=r"sigma sampling must be one of \('logit_normal', 'uniform'\)"):
        draw_training_sigma(gen, "shifted")
