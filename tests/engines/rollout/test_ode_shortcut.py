"""The rollout's ODE shortcuts (rollout.ode_tail / ode_head) on the tiny SD3: off is the plain step-by-step
sampler bit for bit; on, the tail leaves the stored window untouched, makes the counted number of transformer
evaluations and lands near the full-step image."""

from __future__ import annotations

import pytest
import torch

from diffrl.algorithms.windows import WindowPolicy
from diffrl.configs.loader import ConfigError
from diffrl.configs.rollout import OdeShortcut, SamplingConfig
from diffrl.configs.schema import load_experiment
from diffrl.engines.rollout import RolloutEngine
from diffrl.engines.rollout.shortcut import evaluations_per_chunk
from diffrl.engines.rollout.step import denoise_step
from diffrl.models.base import SampleShape, load_adapter

PROMPTS = ["a red cube", "a cat", "a dog on grass", "a tree"]
SEEDS = [1, 2, 3, 4]
STEPS = 10


@pytest.fixture(scope="module")
def engine(tiny_model):
    """A rollout engine on the tiny SD3 whose adapter counts its velocity calls (a spy that calls through)."""
    adapter = load_adapter(tiny_model("sd3"), device="cpu", dtype=torch.float32)
    velocity = adapter.velocity
    adapter.calls = 0

    def counted(*args, **kwargs):
        adapter.calls += 1
        return velocity(*args, **kwargs)

    adapter.velocity = counted
    return RolloutEngine(adapter, progress=False)


def _config(**overrides) -> SamplingConfig:
    base = dict(
        num_inference_steps=STEPS,
        height=32,
        width=32,
        guidance_scale=4.5,
        noise_level=0.7,
        batch_size=4,
        window=WindowPolicy("random_start", size=2, start_range=(0, 3)),
    )
    return SamplingConfig(**{**base, **overrides})


def _generate(engine: RolloutEngine, cfg: SamplingConfig):
    """(trajectories, transformer evaluations counted at the adapter); the engine's own count agrees."""
    before, engine_before = engine.adapter.calls, engine.evaluations
    traj = engine.generate(PROMPTS, ["a", "b", "c", "d"], [0] * 4, SEEDS, cfg)
    calls = engine.adapter.calls - before
    assert engine.evaluations - engine_before == 4 * calls  # one chunk of 4: each forward counts 4 samples
    return traj, calls


def _step_by_step(engine: RolloutEngine, cfg: SamplingConfig, starts: torch.Tensor) -> torch.Tensor:
    """The sampler without shortcuts, written out: every step through denoise_step, SDE noise drawn per sample inside
    its window."""
    adapter, shape = engine.adapter, SampleShape(cfg.height, cfg.width, 1)
    generators = [torch.Generator().manual_seed(s) for s in SEEDS]
    latents = adapter.prepare_latents(shape, generators).float()
    enc, neg, _ = engine.encode(PROMPTS, cfg)
    sigmas = adapter.sigmas(STEPS, shape).float()
    for i in range(STEPS):
        in_window = (starts <= i) & (starts + cfg.window.size > i)
        noise = torch.zeros_like(latents)
        for r in in_window.nonzero().squeeze(1).tolist():
            noise[r] = torch.randn(latents.shape[1:], generator=generators[r])
        latents = denoise_step(
            adapter,
            latents,
            sigmas[i].expand(4),
            sigmas[i + 1].expand(4),
            enc,
            neg,
            guidance_scale=4.5,
            shape=shape,
            noise=noise,
            sde_type=cfg.sde_type,
            noise_level=in_window.float() * cfg.noise_level,
            sigma_max=float(sigmas[1]),
        ).prev_sample
    return adapter.decode(latents, shape)


def test_off_is_the_step_by_step_sampler_bit_for_bit(engine):
    off, calls = _generate(engine, _config())
    assert calls == STEPS
    assert torch.equal(off.images, _step_by_step(engine, _config(), off.window_starts))
    # on, but with as many evaluations as the tail has steps: nothing to save, so nothing changes
    tail = STEPS - int(off.window_starts.max()) - 2
    same, calls = _generate(engine, _config(ode_tail=OdeShortcut("dpm2m", tail), ode_head=OdeShortcut("ab2", 5)))
    assert calls == STEPS
    for name in ("images", "latents", "log_probs", "sigmas", "sigmas_prev"):
        assert torch.equal(getattr(same, name), getattr(off, name)), name


def test_tail_keeps_the_window_and_lands_near_the_full_step_image(engine):
    off, _ = _generate(engine, _config())
    starts = off.window_starts  # measured: [2, 0, 2, 2]: the tail is steps [4, 10)
    errors = {}
    for solver, evaluations in (("euler", 2), ("ab2", 2), ("dpm2m", 3)):
        cfg = _config(ode_tail=OdeShortcut(solver, evaluations))
        on, calls = _generate(engine, cfg)
        for name in ("latents", "log_probs", "sigmas", "sigmas_prev", "window_starts"):
            assert torch.equal(getattr(on, name), getattr(off, name)), (solver, name)
        expected = int(starts.max()) + 2 + evaluations  # the window steps, then the tail's evaluations
        assert calls == expected == evaluations_per_chunk(cfg, starts, 2)
        errors[solver] = (on.images.float() - off.images.float()).abs().mean().item()
    # mean |uint8 difference| from the 10-step image (pixel std 43): measured euler 1.51, ab2 1.25, dpm2m 0.80;
    # the bound leaves ~2.5x margin
    assert all(0 < e < 4.0 for e in errors.values()), errors


def test_dpm2m_with_two_tail_evaluations_is_euler(engine):
    # a 2-point tail to sigma = 0: DPM-Solver++(2M)'s first step is first order and so is its step into sigma = 0
    euler, _ = _generate(engine, _config(ode_tail=OdeShortcut("euler", 2)))
    dpm, _ = _generate(engine, _config(ode_tail=OdeShortcut("dpm2m", 2)))
    assert torch.equal(euler.images, dpm.images)


def test_head_moves_the_window_input_and_saves_evaluations(engine):
    window = WindowPolicy("random_start", size=2, start_range=(5, 7))
    off, _ = _generate(engine, _config(window=window))
    cfg = _config(window=window, ode_head=OdeShortcut("ab2", 2))
    on, calls = _generate(engine, cfg)
    assert calls == 2 + (STEPS - int(off.window_starts.min())) == evaluations_per_chunk(cfg, off.window_starts, 2)
    assert torch.equal(on.window_starts, off.window_starts) and torch.equal(on.sigmas, off.sigmas)
    assert not torch.equal(on.latents[:, 0], off.latents[:, 0])  # the head changes what the windows start from
    drift = (on.latents[:, 0] - off.latents[:, 0]).abs().mean() / off.latents[:, 0].abs().mean()
    assert drift < 0.1, drift  # measured 0.017 (relative mean |difference| of the window-entry latents)


def test_config_section_and_its_checks():
    cfg = load_experiment(None, ["rollout.ode_tail.solver=dpm2m", "rollout.ode_tail.evaluations=3"])
    assert cfg.sampling.ode_tail == OdeShortcut("dpm2m", 3) and not cfg.sampling.ode_head.on
    assert not load_experiment(None, ["rollout.ode_tail.solver=none"]).sampling.ode_tail.on
    with pytest.raises(ConfigError, match=r"rollout.ode_tail: solver must be 'none' \(off\) or one of"):
        load_experiment(None, ["rollout.ode_tail.solver=heun"])
    with pytest.raises(ConfigError, match="evaluations must be >= 1"):
        load_experiment(None, ["rollout.ode_head.evaluations=0"])
