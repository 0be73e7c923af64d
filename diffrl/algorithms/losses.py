"""All losses, one import: policy-gradient (losses_pg), direct-preference (losses_dp) and group (losses_group).

Each returns ``(loss, metrics)`` except :func:`kl_loss`, which returns the scalar loss only
(the trainer adds ``kl_coef * kl_loss`` and logs it as actor/kl_loss).
"""

from diffrl.algorithms.losses_dp import (
    awm_loss,
    diffusion_nft_loss,
    dpo_loss,
    reward_probability,
    sft_loss,
)
from diffrl.algorithms.losses_group import dgpo_loss, gardo_loss
from diffrl.algorithms.losses_pg import distillation_loss, flow_dppo_loss, flow_grpo_loss, grpo_guard_loss, kl_loss

__all__ = [
    "awm_loss",
    "dgpo_loss",
    "distillation_loss",
    "diffusion_nft_loss",
    "dpo_loss",
    "flow_dppo_loss",
    "flow_grpo_loss",
    "gardo_loss",
    "grpo_guard_loss",
    "kl_loss",
    "reward_probability",
    "sft_loss",
]
