"""Named algorithm bundles: one algorithm object per consistent set of published defaults.

A config says ``algorithm: mix_grpo`` and gets the whole bundle; any field of that algorithm can be overridden
(``get_algorithm("mix_grpo", noise_level=0.5)``). Adding an algorithm is one file in algorithms/ (its class: settings,
``needs``, ``loss``) and one ``register(...)`` line below; nothing else keeps a list of names. Where each default
comes from is cited in docs/algorithms.md.
"""

from __future__ import annotations

import dataclasses

from diffrl import registry
from diffrl.algorithms.base import Algorithm, DiffusionAlgorithm, Needs
from diffrl.algorithms.dgpo import DGPO
from diffrl.algorithms.direct_preference import AWM, DiffusionDPO, DiffusionNFT
from diffrl.algorithms.gardo import GARDO
from diffrl.algorithms.gspo import GSPO
from diffrl.algorithms.opd import DiffusionOPD
from diffrl.algorithms.policy_gradient import FlowDPPO, FlowGRPO, GRPOGuard
from diffrl.algorithms.sft import SFT
from diffrl.algorithms.token_pg import DAPO, SequenceDPO, TokenGRPO
from diffrl.algorithms.windows import WindowPolicy

__all__ = ["Algorithm", "DiffusionAlgorithm", "Needs", "algorithms", "get_algorithm", "names_for", "register"]

registry.declare("algorithm", ())  # the bundles below register when this module is imported


def register(algorithm: Algorithm) -> Algorithm:
    """Add a named bundle (an algorithm object with its defaults) to the catalog (diffrl.registry); names are
    unique."""
    return registry.register("algorithm", algorithm.name)(algorithm)


def algorithms() -> dict[str, Algorithm]:
    """Every registered bundle by name."""
    return {name: registry.get("algorithm", name).obj for name in registry.names("algorithm")}


register(FlowGRPO("flow_grpo", kl_coef=0.04))
register(
    FlowGRPO(
        "flow_grpo_fast",
        noise_level=0.8,
        window=WindowPolicy("random_start", size=2, start_range=(0, 4)),
        clip_ratio=1e-5,
    )
)
register(FlowGRPO("mix_grpo", sde_type="dance_sde", window=WindowPolicy("mix_progressive", size=4, iters_per_group=25)))
register(GRPOGuard("grpo_guard", kl_coef=0.04))
# DanceGRPO's advantages: (r - mean) / (torch.std + 1e-8) within each group (ddof 1)
register(
    FlowGRPO(
        "dance_grpo",
        sde_type="dance_sde",
        noise_level=0.3,
        window=WindowPolicy("dance_fraction", timestep_fraction=0.6),
        global_std=False,
        adv_std_ddof=1,
        adv_eps=1e-8,
    )
)
register(FlowDPPO("flow_dppo", kl_threshold=1e-5))
register(DiffusionDPO("dpo", beta=5000.0))
register(DiffusionNFT("diffusion_nft", ref_coef=1e-4, old_policy_decay_ramp=0.001, old_policy_decay_max=0.5))
register(AWM("awm", ref_coef=0.1))
register(DGPO("dgpo"))
register(GARDO("gardo"))
register(DiffusionOPD("diffusion_opd"))
register(SFT("sft"))

# On an autoregressive model's tokens (Needs.data "tokens"); names distinct from the diffusion bundles above
# ("dpo" is Diffusion-DPO; DPO on token sequences is "sequence_dpo").
register(TokenGRPO("grpo"))
register(TokenGRPO("dr_grpo", norm_by_std=False, aggregation="seq-mean-token-sum-norm"))
register(DAPO("dapo"))
register(GSPO("gspo"))
register(SequenceDPO("sequence_dpo"))


def names_for(tokens: bool) -> list[str]:
    """The bundles that train on tokens (an autoregressive model) or, tokens=False, on a diffusion model's samples."""
    return sorted(name for name, a in algorithms().items() if (a.needs.data == "tokens") == tokens)


def get_algorithm(name: str, **overrides) -> Algorithm:
    """The named bundle with ``overrides`` applied (each must be a field of that algorithm).

    A ``window`` override may be a WindowPolicy or a dict of WindowPolicy fields, which
    replaces only those fields of the bundle's window.
    """
    algorithm = registry.get("algorithm", name).obj
    valid = [f.name for f in dataclasses.fields(algorithm)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown Algorithm field(s) {unknown} for {name!r}; valid fields: {valid}")
    if "name" in overrides:
        raise ValueError("Algorithm.name cannot be overridden: it selects the bundle")
    window = overrides.get("window")
    if isinstance(window, dict):
        window_fields = [f.name for f in dataclasses.fields(WindowPolicy)]
        bad = sorted(set(window) - set(window_fields))
        if bad:
            raise ValueError(f"unknown WindowPolicy field(s) {bad}; valid fields: {window_fields}")
        overrides = {**overrides, "window": dataclasses.replace(algorithm.window, **window)}
    return dataclasses.replace(algorithm, **overrides)
