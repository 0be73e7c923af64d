"""SFT: supervised flow matching on (prompt, image) pairs of a dataset, the warm start before RL.

loss = mean ||v_theta(x_t, sigma, c) - (noise - x0)||^2 with x0 the VAE latents of a dataset image and
x_t = (1 - sigma) x0 + sigma noise (the direct-preference family's SampleBatch conventions; the math is
:func:`~diffrl.algorithms.losses_dp.sft_loss`). Its checkpoints are an RL run's: ``run.init_from`` starts RL from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffrl.algorithms.base import DiffusionAlgorithm, Metrics, Needs, check_fields
from diffrl.algorithms.batches import SampleBatch
from diffrl.algorithms.losses_dp import sft_loss
from diffrl.algorithms.windows import WindowPolicy

# How SFT draws a sample's sigma: logit-normal as SD3 trains (the default), or uniform on (0, 1).
SIGMA_SAMPLING = ("logit_normal", "uniform")


def _final_window() -> WindowPolicy:
    return WindowPolicy("final", size=1)


def draw_training_sigma(generator: torch.Generator, sampling: str, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """One 0-dim fp32 sigma in (0, 1): sigmoid(mean + std * N(0, 1)) ("logit_normal", SD3's rf/lognorm(m, s), Esser
    et al. 2024 section 3.1; diffusers' compute_density_for_timestep_sampling) or U(0, 1) ("uniform", rectified flow
    as Liu et al. 2022 train it)."""
    if sampling == "logit_normal":
        return torch.sigmoid(mean + std * torch.randn((), generator=generator))
    if sampling == "uniform":
        return torch.rand((), generator=generator)
    raise ValueError(f"sigma sampling must be one of {SIGMA_SAMPLING}; got {sampling!r}")


@dataclass(frozen=True)
class SFT(DiffusionAlgorithm):
    """Supervised fine-tuning by flow matching (Lipman et al. 2023, arXiv:2210.02747), with the timestep density of
    SD3's training (Esser et al. 2024, arXiv:2403.03206: logit-normal, m = 0, s = 1; diffusers' SD3 LoRA example's
    default ``weighting_scheme: logit_normal``). Needs ``data.sample_source: offline`` and a dataset of prompt and
    image columns in ``data.train``; no rollout, reward or advantages.

    sigma_sampling: "logit_normal" (sigmoid(logit_mean + logit_std * N(0, 1))) or "uniform" (U(0, 1)).
    logit_mean, logit_std: the logit-normal's parameters.

    Deviations from diffusers' SD3 example: sigma is the drawn value itself, without the scheduler's resolution shift
    (the example indexes its shifted training schedule with it); no per-timestep loss weighting (its default,
    logit_normal, weights 1); the velocity is conditional only (no caption dropout).
    """

    NO_EMA_REFERENCE = "it has no reference policy (no KL or reference penalty)"

    noise_level: float = 0.0
    window: WindowPolicy = field(default_factory=_final_window)
    sigma_sampling: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, positive=("logit_std",))
        if self.sigma_sampling not in SIGMA_SAMPLING:
            raise ValueError(f"Algorithm.sigma_sampling must be one of {SIGMA_SAMPLING}; got {self.sigma_sampling!r}")

    @property
    def needs(self) -> Needs:
        return Needs("final_samples", supervised=True, draws_sigmas=True)

    def draw_sigma(self, generator: torch.Generator) -> torch.Tensor:
        """The sigma a sample is re-noised at (Needs.draws_sigmas)."""
        return draw_training_sigma(generator, self.sigma_sampling, self.logit_mean, self.logit_std)

    def loss(self, batch: SampleBatch) -> tuple[torch.Tensor, Metrics]:
        return sft_loss(batch.velocity, batch.target)
