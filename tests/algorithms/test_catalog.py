"""diffrl.algorithms.catalog: every bundle is consistent and declares its needs, its loss is the pure function's,
overrides, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffrl.algorithms import losses
from diffrl.algorithms.batches import SampleBatch, StepBatch
from diffrl.algorithms.catalog import DiffusionAlgorithm, Needs, algorithms, get_algorithm, register
from diffrl.algorithms.windows import WindowPolicy

D = torch.float64

# What each bundle needs from a step: (data, old_means, reference, old_adapter, pairs).
NEEDS = {
    "flow_grpo": ("denoising_steps", False, True, False, False),  # kl_coef 0.04
    "flow_grpo_fast": ("denoising_steps", False, False, False, False),
    "mix_grpo": ("denoising_steps", False, False, False, False),
    "grpo_guard": ("denoising_steps", True, True, False, False),
    "dance_grpo": ("denoising_steps", False, False, False, False),
    "flow_dppo": ("denoising_steps", True, False, False, False),
    "dpo": ("final_samples", False, True, False, True),
    "diffusion_nft": ("final_samples", False, True, True, False),  # ref_coef 1e-4
    "awm": ("final_samples", False, True, False, False),  # ref_coef 0.1
    "dgpo": ("final_samples", False, True, True, False),  # kl_coef 0.02; the old adapter for the clip
    "gardo": ("denoising_steps", False, True, True, False),  # the KL's reference is the periodically reset adapter
    "sft": ("final_samples", False, False, False, False),  # a dataset's images, no reward
    "diffusion_opd": ("denoising_steps", False, False, False, False),  # a teacher instead of rewards
}


# The token bundles: (old_log_probs, reference, pairs, varied_groups); all train on "tokens".
TOKEN_NEEDS = {
    "grpo": (True, False, False, False),
    "dr_grpo": (True, False, False, False),
    "dapo": (True, False, False, True),
    "gspo": (True, False, False, False),
    "sequence_dpo": (False, True, True, False),
}


def test_all_named_bundles_exist_and_declare_their_needs():
    assert sorted(algorithms()) == sorted({**NEEDS, **TOKEN_NEEDS})
    for name, (old_log_probs, reference, pairs, varied) in TOKEN_NEEDS.items():
        needs = get_algorithm(name).needs
        assert (needs.data, needs.old_log_probs, needs.reference, needs.pairs) == (
            "tokens",
            old_log_probs,
            reference,
            pairs,
        )
        assert needs.varied_groups == varied and not needs.overlong_shaping, name
    assert get_algorithm("grpo", kl_coef=0.04).needs.reference
    assert get_algorithm("dapo", overlong_buffer=4).needs.overlong_shaping
    assert not get_algorithm("dapo", dynamic_sampling=False).needs.varied_groups
    dr = get_algorithm("dr_grpo")  # Dr.GRPO: no std normalisation, constant-length token sum
    assert (dr.norm_by_std, dr.aggregation) == (False, "seq-mean-token-sum-norm")
    for name, (data, old_means, reference, old_adapter, pairs) in NEEDS.items():
        algo = get_algorithm(name)
        assert algo.name == name and isinstance(algo, DiffusionAlgorithm)
        needs = algo.needs
        assert (needs.data, needs.old_means, needs.reference, needs.old_adapter, needs.pairs) == (
            data,
            old_means,
            reference,
            old_adapter,
            pairs,
        ), name
        assert needs.old_log_probs == (data == "denoising_steps" and name != "diffusion_opd"), name
        assert needs.teacher == (name == "diffusion_opd"), name
        assert needs.samples_with_old_adapter == (name == "diffusion_nft")
        assert needs.groups == (name == "dgpo") and needs.moving_reference == (name == "gardo"), name
        assert needs.supervised == needs.draws_sigmas == (name == "sft"), name
    # the settings that switch a need
    assert not get_algorithm("flow_grpo", kl_coef=0.0).needs.reference
    assert not get_algorithm("awm", ref_coef=0.0).needs.reference
    assert not get_algorithm("diffusion_nft", ref_coef=0.0).needs.reference
    assert get_algorithm("flow_dppo", kl_coef=0.01).needs.reference
    # DGPO: the group preference's reference is the reference policy, or the EMA adapter (no reference forward
    # without a KL); no clip and no EMA reference: no old adapter
    assert not get_algorithm("dgpo", kl_coef=0.0, ema_reference=True).needs.reference
    assert get_algorithm("dgpo", kl_coef=0.0, ema_reference=True).needs.old_adapter
    assert not get_algorithm("dgpo", clip_ratio=0.0).needs.old_adapter
    # GARDO: reset 0 is Flow-GRPO's frozen reference; no KL, no reference at all
    frozen = get_algorithm("gardo", reference_reset_every=0).needs
    assert frozen.reference and not frozen.moving_reference and not frozen.old_adapter
    assert not get_algorithm("gardo", kl_coef=0.0).needs.reference
    assert not get_algorithm("gardo").needs.reward_gate  # kl_gate_fraction 1: every sample pays the KL
    assert get_algorithm("gardo", kl_gate_fraction=0.1, main_reward="ocr").needs.reward_gate
    # DiffusionOPD with the reward term (an SDE rollout) needs old log-probs; with the reference KL, the reference
    assert get_algorithm("diffusion_opd", pg_coef=0.5, noise_level=0.7).needs.old_log_probs
    assert get_algorithm("diffusion_opd", kl_coef=0.01).needs.reference


def test_published_defaults():
    fg = get_algorithm("flow_grpo")
    assert (fg.noise_level, fg.clip_ratio, fg.adv_clip_max, fg.kl_coef) == (0.7, 1e-4, 5.0, 0.04)
    assert get_algorithm("dance_grpo").window == WindowPolicy("dance_fraction", timestep_fraction=0.6)
    assert get_algorithm("mix_grpo").window.kind == "mix_progressive"
    dgpo = get_algorithm("dgpo")  # Luo-Yihong/DGPO config/dgpo.py general_ocr_sd3_4gpu
    assert (dgpo.beta, dgpo.clip_ratio, dgpo.kl_coef, dgpo.adv_clip_max) == (100.0, 1e-2, 0.02, 5.0)
    assert (dgpo.old_policy_decay_ramp, dgpo.old_policy_decay_max, dgpo.ema_reference) == (0.001, 0.3, False)
    assert dgpo.train_sigma_steps == 7  # trunc_steps 6: step indices 0..6
    sft = get_algorithm("sft")  # SD3's logit-normal timestep density (Esser et al. 2024: m 0, s 1)
    assert (sft.sigma_sampling, sft.logit_mean, sft.logit_std) == ("logit_normal", 0.0, 1.0)
    gardo = get_algorithm("gardo")  # flow_grpo config/grpo_gardo.py general_ocr_sd3
    assert (gardo.kl_coef, gardo.reference_reset_every, gardo.norm_by_std, gardo.clip_ratio) == (0.04, 16, False, 1e-4)
    assert [gardo.old_adapter_decay(k) for k in (1, 15, 16, 17, 32)] == [1.0, 1.0, 0.0, 1.0, 0.0]
    opd = get_algorithm("diffusion_opd")  # ali-vilab/DiffusionOPD config/opd.py sopd_*; verl-omni distill_loss_coef
    assert (opd.noise_level, opd.window, opd.distill_coef) == (0.0, WindowPolicy("all_but_last"), 1.0)
    assert (opd.fm_coef, opd.pg_coef, opd.kl_coef) == (0.0, 0.0, 0.0)
    for name in ("dpo", "diffusion_nft", "awm", "dgpo", "sft"):  # ODE rollouts whose window is the final step
        algo = get_algorithm(name)
        assert (algo.noise_level, algo.window) == (0.0, WindowPolicy("final", size=1)), name


def _step_batch(seed: int = 0, b: int = 4) -> StepBatch:
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(b, generator=g, dtype=D)
    mean = torch.randn(b, 3, 2, generator=g, dtype=D)
    return StepBatch(
        log_prob=old + 0.3 * torch.randn(b, generator=g, dtype=D),
        old_log_prob=old,
        advantages=2 * torch.randn(b, generator=g, dtype=D),
        prev_sample_mean=mean,
        std_dev_t=torch.full((b, 1, 1), 0.4, dtype=D),
        sqrt_dt=torch.full((b, 1, 1), 0.3, dtype=D),
        weights=torch.tensor([1.0, 0.5, 1.0, 0.0], dtype=D),
        old_prev_sample_mean=mean + 0.01 * torch.randn(b, 3, 2, generator=g, dtype=D),
        ref_prev_sample_mean=mean + 0.1 * torch.randn(b, 3, 2, generator=g, dtype=D),
    )


def _sample_batch(seed: int = 0, b: int = 4) -> SampleBatch:
    g = torch.Generator().manual_seed(seed)
    x0, noise = torch.randn(b, 3, 2, generator=g, dtype=D), torch.randn(b, 3, 2, generator=g, dtype=D)
    sigma = torch.rand(b, generator=g, dtype=D)
    s = sigma.view(b, 1, 1)
    velocity = noise - x0 + 0.2 * torch.randn(b, 3, 2, generator=g, dtype=D)
    return SampleBatch(
        velocity=velocity,
        target=noise - x0,
        x_t=(1 - s) * x0 + s * noise,
        x0=x0,
        sigma=sigma,
        advantages=torch.randn(b, generator=g, dtype=D),
        old_velocity=velocity + 0.05 * torch.randn(b, 3, 2, generator=g, dtype=D),
        ref_velocity=velocity + 0.1 * torch.randn(b, 3, 2, generator=g, dtype=D),
    )


def _equal(got, expected) -> None:
    assert torch.equal(got[0], expected[0])
    assert sorted(got[1]) == sorted(expected[1]) and all(torch.equal(got[1][k], v) for k, v in expected[1].items())


def test_each_bundles_loss_is_its_pure_loss_function():
    """The objects only route the batch to the math of algorithms/losses*.py (bit-identical, fp64)."""
    sb, fb = _step_batch(), _sample_batch()
    fg = get_algorithm("flow_grpo", clip_ratio=0.2)
    loss, metrics = losses.flow_grpo_loss(
        sb.log_prob, sb.old_log_prob, sb.advantages, clip_ratio=0.2, adv_clip_max=5.0, weights=sb.weights
    )
    kl = losses.kl_loss(sb.prev_sample_mean, sb.ref_prev_sample_mean, sb.std_dev_t)
    _equal(fg.loss(sb), (loss + 0.04 * kl, {**metrics, "actor/kl_loss": kl}))
    means = dict(
        prev_sample_mean=sb.prev_sample_mean,
        old_prev_sample_mean=sb.old_prev_sample_mean,
        std_dev_t=sb.std_dev_t,
        sqrt_dt=sb.sqrt_dt,
        weights=sb.weights,
    )
    guard = get_algorithm("grpo_guard", kl_coef=0.0)
    expected = losses.grpo_guard_loss(
        sb.log_prob, sb.old_log_prob, sb.advantages, clip_ratio=1e-4, adv_clip_max=5.0, **means
    )
    _equal(guard.loss(sb), expected)
    dppo = get_algorithm("flow_dppo")
    expected = losses.flow_dppo_loss(
        sb.log_prob, sb.old_log_prob, sb.advantages, kl_threshold=1e-5, adv_clip_max=5.0, **means
    )
    _equal(dppo.loss(sb), expected)
    err = ((fb.velocity - fb.target) ** 2).flatten(1).mean(1)
    ref_err = ((fb.ref_velocity - fb.target) ** 2).flatten(1).mean(1)
    _equal(
        get_algorithm("dpo").loss(fb), losses.dpo_loss(err[0::2], err[1::2], ref_err[0::2], ref_err[1::2], beta=5000.0)
    )
    nft = get_algorithm("diffusion_nft", mix_beta=0.3)
    expected = losses.diffusion_nft_loss(
        fb.velocity,
        fb.old_velocity,
        fb.x_t,
        fb.x0,
        fb.sigma,
        fb.advantages,
        adv_clip_max=5.0,
        mix_beta=0.3,
        ref_velocity=fb.ref_velocity,
        ref_coef=1e-4,
    )
    _equal(nft.loss(fb), expected)
    awm = get_algorithm("awm", awm_weighting="t")
    expected = losses.awm_loss(
        fb.velocity,
        fb.target,
        fb.sigma,
        fb.advantages,
        adv_clip_max=5.0,
        ref_velocity=fb.ref_velocity,
        ref_coef=0.1,
        weighting="t",
    )
    _equal(awm.loss(fb), expected)
    groups = dataclasses.replace(fb, group_index=torch.tensor([0, 0, 1, 1]))
    expected = losses.dgpo_loss(
        fb.velocity,
        fb.target,
        fb.ref_velocity,
        fb.advantages,
        groups.group_index,
        beta=100.0,
        adv_clip_max=5.0,
        old_velocity=fb.old_velocity,
        clip_ratio=1e-2,
        kl_velocity=fb.ref_velocity,
        kl_coef=0.02,
    )
    _equal(get_algorithm("dgpo").loss(groups), expected)
    expected = losses.dgpo_loss(
        fb.velocity, fb.target, fb.old_velocity, fb.advantages, groups.group_index, beta=100.0, adv_clip_max=5.0
    )
    _equal(get_algorithm("dgpo", ema_reference=True, clip_ratio=0.0, kl_coef=0.0).loss(groups), expected)
    expected = losses.gardo_loss(
        sb.log_prob,
        sb.old_log_prob,
        sb.advantages,
        prev_sample_mean=sb.prev_sample_mean,
        std_dev_t=sb.std_dev_t,
        clip_ratio=1e-4,
        adv_clip_max=5.0,
        ref_prev_sample_mean=sb.ref_prev_sample_mean,
        kl_coef=0.04,
        weights=sb.weights,
    )
    _equal(get_algorithm("gardo").loss(sb), expected)
    _equal(get_algorithm("sft").loss(fb), losses.sft_loss(fb.velocity, fb.target))
    tb = _teacher_batch(sb)
    distill = losses.distillation_loss(
        tb.prev_sample_mean,
        tb.teacher_prev_sample_mean,
        tb.std_dev_t,
        velocity=tb.velocity,
        teacher_velocity=tb.teacher_velocity,
        kl_coef=1.0,
        fm_coef=0.5,
        weights=tb.weights,
    )
    pg = losses.flow_grpo_loss(
        tb.log_prob, tb.old_log_prob, tb.advantages, clip_ratio=1e-4, adv_clip_max=5.0, weights=tb.weights
    )
    opd = get_algorithm("diffusion_opd", fm_coef=0.5, pg_coef=0.25, noise_level=0.7)
    _equal(opd.loss(tb), (distill[0] + 0.25 * pg[0], {**pg[1], **distill[1]}))
    _equal(get_algorithm("diffusion_opd", fm_coef=0.5).loss(tb), distill)


def _teacher_batch(sb: StepBatch) -> StepBatch:
    g = torch.Generator().manual_seed(7)
    velocity = torch.randn(sb.prev_sample_mean.shape, generator=g, dtype=D)
    return dataclasses.replace(
        sb,
        velocity=velocity,
        teacher_velocity=velocity + 0.2 * torch.randn(velocity.shape, generator=g, dtype=D),
        teacher_prev_sample_mean=sb.prev_sample_mean + 0.1 * torch.randn(velocity.shape, generator=g, dtype=D),
    )


def test_a_missing_input_the_algorithm_needs_is_a_clear_error():
    sb, fb = _step_batch(), _sample_batch()
    with pytest.raises(ValueError, match="ref_prev_sample_mean"):
        get_algorithm("flow_grpo").loss(dataclasses.replace(sb, ref_prev_sample_mean=None))
    with pytest.raises(ValueError, match="ref_velocity"):
        get_algorithm("dpo").loss(dataclasses.replace(fb, ref_velocity=None))
    with pytest.raises(ValueError, match="old_velocity"):
        get_algorithm("diffusion_nft").loss(dataclasses.replace(fb, old_velocity=None))
    with pytest.raises(ValueError, match="group_index"):
        get_algorithm("dgpo").loss(fb)
    with pytest.raises(ValueError, match="ref_prev_sample_mean"):
        get_algorithm("gardo").loss(dataclasses.replace(sb, ref_prev_sample_mean=None))
    with pytest.raises(ValueError, match="teacher_prev_sample_mean"):
        get_algorithm("diffusion_opd").loss(sb)
    with pytest.raises(ValueError, match="velocities"):
        get_algorithm("diffusion_opd", fm_coef=1.0).loss(dataclasses.replace(_teacher_batch(sb), teacher_velocity=None))


def test_overrides():
    algo = get_algorithm("mix_grpo", noise_level=0.5, window={"size": 2})
    assert algo.noise_level == 0.5 and algo.window.size == 2 and algo.window.kind == "mix_progressive"
    assert get_algorithm("flow_grpo", window=WindowPolicy("random_start", size=3)).window.size == 3
    assert get_algorithm("diffusion_nft").old_adapter_decay(100) == pytest.approx(0.1)
    assert get_algorithm("diffusion_nft").old_adapter_decay(10_000) == 0.5
    assert get_algorithm("flow_grpo", kl_coef=0.0) == dataclasses.replace(get_algorithm("flow_grpo"), kl_coef=0.0)


def test_errors():
    with pytest.raises(
        ValueError, match=r"unknown algorithm .ppo. \(did you mean .dpo.\?\); choose one of .*flow_grpo"
    ):
        get_algorithm("ppo")
    with pytest.raises(ValueError, match="noise_levl.*valid fields"):
        get_algorithm("flow_grpo", noise_levl=0.3)
    # a field of another algorithm is not one of this one's: no setting is silently unread
    with pytest.raises(ValueError, match=r"unknown Algorithm field\(s\) \['beta'\] for 'flow_grpo'; valid fields: "):
        get_algorithm("flow_grpo", beta=100.0)
    with pytest.raises(ValueError, match="sde_type"):
        get_algorithm("flow_grpo", sde_type="ode")
    with pytest.raises(ValueError, match="WindowPolicy field"):
        get_algorithm("flow_grpo", window={"sise": 3})
    with pytest.raises(ValueError, match="awm_weighting must be one of"):
        get_algorithm("awm", awm_weighting="huber")
    with pytest.raises(ValueError, match=r"Algorithm.clip_ratio must be > 0"):
        get_algorithm("grpo_guard", clip_ratio=0.0)
    with pytest.raises(ValueError, match="already registered"):
        register(get_algorithm("flow_grpo"))
    with pytest.raises(ValueError, match="Needs.data must be one of"):
        Needs("images")
    with pytest.raises(ValueError, match=r"Algorithm.beta must be > 0"):
        get_algorithm("dgpo", beta=0.0)
    with pytest.raises(ValueError, match=r"Algorithm.clip_ratio must be >= 0"):
        get_algorithm("dgpo", clip_ratio=-0.1)
    with pytest.raises(ValueError, match=r"old_policy_decay_max must be in \[0, 1\]"):
        get_algorithm("dgpo", old_policy_decay_max=1.5)
    with pytest.raises(ValueError, match=r"kl_gate_fraction must be in \(0, 1\]"):
        get_algorithm("gardo", kl_gate_fraction=0.0)
    with pytest.raises(ValueError, match="main_reward must name the reward component"):
        get_algorithm("gardo", kl_gate_fraction=0.1)
    with pytest.raises(ValueError, match="main_reward 'ocr' must be one of the reward components"):
        get_algorithm("gardo", kl_gate_fraction=0.1, main_reward="ocr").reward_gate({"ocr": torch.zeros(3)})
    with pytest.raises(ValueError, match="Needs.reward_gate"):
        Needs("final_samples", reward_gate=True)
    with pytest.raises(ValueError, match=r"Algorithm.sigma_sampling must be one of \('logit_normal', 'uniform'\)"):
        get_algorithm("sft", sigma_sampling="shifted")
    with pytest.raises(ValueError, match=r"reference 'ema' does not apply to 'sft': it has no reference policy"):
        get_algorithm("sft", reference="ema", reference_decay=0.5)
    with pytest.raises(ValueError, match=r"Algorithm.logit_std must be > 0"):
        get_algorithm("sft", logit_std=0.0)
    with pytest.raises(ValueError, match="Needs.supervised trains on single dataset samples"):
        Needs("final_samples", supervised=True, pairs=True)
    with pytest.raises(ValueError, match="Needs.supervised and Needs.draws_sigmas re-noise final samples"):
        Needs("denoising_steps", draws_sigmas=True)
    with pytest.raises(ValueError, match="diversity_aware must be false.*image features"):
        get_algorithm("gardo", diversity_aware=True)
    with pytest.raises(ValueError, match="reference_reset_every must be >= 0"):
        get_algorithm("gardo", reference_reset_every=-1)
    with pytest.raises(ValueError, match="moving_reference .*needs reference and old_adapter"):
        Needs("denoising_steps", moving_reference=True)
    with pytest.raises(ValueError, match="Needs.groups"):
        Needs("final_samples", groups=True, pairs=True)
    with pytest.raises(ValueError, match="pg_coef > 0 needs Algorithm.noise_level > 0"):
        get_algorithm("diffusion_opd", pg_coef=1.0)
    with pytest.raises(ValueError, match="distill_coef or Algorithm.fm_coef must be > 0"):
        get_algorithm("diffusion_opd", distill_coef=0.0)
    with pytest.raises(ValueError, match="Needs.teacher"):
        Needs("final_samples", teacher=True)
