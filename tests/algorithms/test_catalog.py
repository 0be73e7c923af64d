"""diffrl.algorithms.catalog: every bundle is consistent, overrides, errors."""

from __future__ import annotations

import pytest

from diffrl.algorithms import losses
from diffrl.algorithms.catalog import ALGORITHMS, Algorithm, get_algorithm, loss_fn, old_policy_decay
from diffrl.algorithms.windows import WindowPolicy

NAMES = [
    "flow_grpo",
    "flow_grpo_fast",
    "mix_grpo",
    "grpo_guard",
    "dance_grpo",
    "flow_dppo",
    "dpo",
    "diffusion_nft",
    "awm",
]


def test_all_named_bundles_exist_and_resolve_their_loss():
    assert sorted(ALGORITHMS) == sorted(NAMES)
    for name in NAMES:
        algo = get_algorithm(name)
        assert algo.name == name and isinstance(algo, Algorithm)
        assert loss_fn(algo) is getattr(losses, algo.loss)


def test_published_defaults():
    fg = get_algorithm("flow_grpo")
    assert (fg.noise_level, fg.clip_ratio, fg.adv_clip_max, fg.kl_coef) == (0.7, 1e-4, 5.0, 0.04)
    assert get_algorithm("dance_grpo").window == WindowPolicy("dance_fraction", timestep_fraction=0.6)
    assert get_algorithm("mix_grpo").window.kind == "mix_progressive"
    assert get_algorithm("diffusion_nft").family == "direct_preference"


def test_overrides():
    algo = get_algorithm("mix_grpo", noise_level=0.5, window={"size": 2})
    assert algo.noise_level == 0.5 and algo.window.size == 2 and algo.window.kind == "mix_progressive"
    assert get_algorithm("flow_grpo", window=WindowPolicy("random_start", size=3)).window.size == 3
    assert old_policy_decay(get_algorithm("diffusion_nft"), 100) == pytest.approx(0.1)
    assert old_policy_decay(get_algorithm("diffusion_nft"), 10_000) == 0.5


def test_errors():
    with pytest.raises(ValueError, match="known: .*flow_grpo"):
        get_algorithm("ppo")
    with pytest.raises(ValueError, match="noise_levl.*valid fields"):
        get_algorithm("flow_grpo", noise_levl=0.3)
    with pytest.raises(ValueError, match="sde_type"):
        get_algorithm("flow_grpo", sde_type="ode")
    with pytest.raises(ValueError, match="WindowPolicy field"):
        get_algorithm("flow_grpo", window={"sise": 3})
