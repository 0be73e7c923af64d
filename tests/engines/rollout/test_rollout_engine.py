"""The rollout engine on every tiny architecture: upstream parity at noise level 0, replay = rollout
log-probs, stochasticity only inside the window, batch independence, shapes, the prompt cache."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from rollout_archs import ArchCase, arch_params, pipeline_pixels

from diffrl.algorithms.windows import WindowPolicy
from diffrl.configs.rollout import SamplingConfig
from diffrl.engines.rollout import RolloutEngine
from diffrl.models.base import SampleShape, load_adapter

PROMPT = "a red cube on a blue table"
STEPS = 4


@pytest.fixture(scope="module")
def adapters(tiny_model):
    """arch -> loaded adapter (CPU fp32), loaded once per module."""
    loaded = {}

    def get(case: ArchCase):
        if case.arch not in loaded:
            path = tiny_model(case.arch)
            loaded[case.arch] = (path, load_adapter(path, device="cpu", dtype=torch.float32))
        return loaded[case.arch]

    return get


def config(case: ArchCase, **overrides) -> SamplingConfig:
    base = dict(
        num_inference_steps=STEPS,
        height=case.height,
        width=case.width,
        num_frames=case.num_frames,
        guidance_scale=case.guidance_scale,
        negative_prompt=case.negative_prompt,
        noise_level=0.7,
        batch_size=4,
    )
    return SamplingConfig(**{**base, **overrides})


@pytest.mark.parametrize("case", arch_params())
def test_noise_level_0_equals_upstream_pipeline(case, adapters):
    path, adapter = adapters(case)
    engine = RolloutEngine(adapter, progress=False)
    traj = engine.generate([PROMPT], ["g0"], [0], [7], config(case, noise_level=0.0))
    expected = pipeline_pixels(path, case, PROMPT, seed=7, steps=STEPS)
    got = traj.images[0].numpy()
    assert got.shape == expected.shape and got.dtype == np.uint8
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1


@pytest.fixture(scope="module")
def rollouts(adapters):
    """arch -> (engine, cfg, trajectories of two samples at noise level 0.7), sampled once per module."""
    done = {}

    def get(case: ArchCase):
        if case.arch not in done:
            engine = RolloutEngine(adapters(case)[1], progress=False)
            cfg = config(case, batch_size=2)
            traj = engine.generate(
                [PROMPT, "a cat"], ["g0", "g1"], [0, 1], [3, 4], cfg, metadata=[{"i": 0}, {"i": 1}], policy_version=4
            )
            done[case.arch] = (engine, cfg, traj)
        return done[case.arch]

    return get


@pytest.mark.parametrize("case", arch_params())
def test_replay_log_prob_equals_rollout_log_prob(case, rollouts):
    engine, cfg, traj = rollouts(case)
    assert traj.window_size == STEPS - 1
    assert (traj.log_probs != 0).all()  # every window step was stochastic
    for j in range(traj.window_size):
        replayed = engine.replay(traj, j, cfg)
        assert replayed.log_prob.requires_grad  # the trainer differentiates it
        torch.testing.assert_close(replayed.log_prob.detach(), traj.log_probs[:, j], rtol=0, atol=1e-6)


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
@pytest.mark.parametrize("case", arch_params(["sd3"]))
def test_replay_matches_for_every_sde_type_and_mixed_windows(case, sde_type, adapters):
    _, adapter = adapters(case)
    engine = RolloutEngine(adapter, progress=False)
    # Per-sample window starts: the batch mixes steps at different sigmas (per-sample noise levels).
    cfg = config(case, sde_type=sde_type, window=WindowPolicy("random_start", size=2))
    seeds = [11, 12, 13, 14]
    traj = engine.generate([PROMPT] * 4, ["g"] * 4, [0, 1, 2, 3], seeds, cfg)
    assert len(set(traj.window_starts.tolist())) > 1, "seeds were picked to give different window starts"
    for j in range(traj.window_size):
        replayed = engine.replay(traj, j, cfg)
        torch.testing.assert_close(replayed.log_prob.detach(), traj.log_probs[:, j], rtol=0, atol=1e-6)
    sig = adapter.sigmas(STEPS, SampleShape(case.height, case.width))
    assert torch.equal(traj.sigmas, sig[traj.step_indices])
    assert torch.equal(traj.sigmas_prev, sig[traj.step_indices + 1])


@pytest.mark.parametrize("case", arch_params())
def test_only_window_steps_are_stochastic(case, adapters):
    """Two samples of one group share their initial noise (same_noise_per_group) but have different
    seeds: they agree exactly up to the window, differ inside it, and the step after the window is the
    Euler ODE step."""
    _, adapter = adapters(case)
    engine = RolloutEngine(adapter, progress=False)
    cfg = config(case, same_noise_per_group=True, window=WindowPolicy("random_start", size=2, start_range=(1, 2)))
    traj = engine.generate([PROMPT, PROMPT], ["g", "g"], [0, 1], [21, 22], cfg)
    shape = SampleShape(case.height, case.width, case.num_frames)
    assert traj.window_starts.tolist() == [1, 1]
    # Step 0 is deterministic from the shared initial noise, so the window starts from the same x.
    assert torch.equal(traj.latents[0, 0], traj.latents[1, 0])
    initial = adapter.prepare_latents(shape, [torch.Generator().manual_seed(21)])
    enc, neg, _ = engine.encode([PROMPT], cfg)
    sig = adapter.sigmas(STEPS, shape)
    g = cfg.guidance_scale
    with torch.no_grad():
        v0 = adapter.velocity(initial, sig[0].expand(1), enc, neg, guidance_scale=g, shape=shape)
        torch.testing.assert_close(traj.latents[0, 0], (initial + (sig[1] - sig[0]) * v0)[0], rtol=0, atol=1e-6)
        # Window steps are stochastic: different seeds give different samples.
        assert (traj.latents[0, 1:] - traj.latents[1, 1:]).abs().max() > 1e-3
        # The last step (after the window) is the ODE step: decode(x3 + v dt) is the image.
        x3 = traj.latents[:, -1]
        v3 = adapter.velocity(
            x3, sig[3].expand(2), *engine.encode([PROMPT] * 2, cfg)[:2], guidance_scale=g, shape=shape
        )
        expected = adapter.decode(x3 + (sig[4] - sig[3]) * v3, shape)
    assert (expected.int() - traj.images.int()).abs().max() <= 1


@pytest.mark.parametrize("case", arch_params())
def test_sample_does_not_depend_on_batch_composition(case, rollouts):
    engine, cfg, both = rollouts(case)
    single = dataclasses.replace(cfg, batch_size=1)
    one = engine.generate([PROMPT], ["g0"], [0], [3], single)
    two = engine.generate(["a cat"], ["g1"], [1], [4], single)
    # Batched matmuls may round differently from single ones; nothing else may differ.
    torch.testing.assert_close(both.latents, torch.cat([one.latents, two.latents]), rtol=0, atol=1e-4)
    torch.testing.assert_close(both.log_probs, torch.cat([one.log_probs, two.log_probs]), rtol=0, atol=1e-4)
    assert (both.images.int() - torch.cat([one.images, two.images]).int()).abs().max() <= 1


@pytest.mark.parametrize("case", arch_params())
def test_trajectory_shapes(case, rollouts, adapters):
    engine, cfg, traj = rollouts(case)
    adapter = adapters(case)[1]
    shape = SampleShape(case.height, case.width, case.num_frames)
    initial = adapter.prepare_latents(shape, [torch.Generator().manual_seed(4)])
    w = STEPS - 1
    assert traj.latents.shape == (2, w + 1, *initial.shape[1:]) and traj.latents.dtype == torch.float32
    assert traj.log_probs.shape == traj.sigmas.shape == traj.sigmas_prev.shape == traj.trained.shape == (2, w)
    image = (case.num_frames, case.height, case.width, 3) if adapter.is_video else (case.height, case.width, 3)
    assert traj.images.shape == (2, *image) and traj.images.dtype == torch.uint8
    assert traj.seeds.tolist() == [3, 4] and traj.sample_index.tolist() == [0, 1]
    assert traj.window_starts.tolist() == [0, 0] and traj.trained.all()
    assert traj.embed_keys == [engine.embed_key(PROMPT, cfg), engine.embed_key("a cat", cfg)]
    assert traj.metadata == [{"i": 0}, {"i": 1}] and traj.policy_version == 4
    sig = adapter.sigmas(STEPS, shape)
    assert torch.equal(traj.sigmas[0], sig[:w]) and torch.equal(traj.sigmas_prev[0], sig[1 : w + 1])
    # The window starts at step 0: the first stored latent is the sample's own initial noise.
    assert torch.equal(traj.latents[1, 0], initial[0])


class DictCache:
    """An in-memory stand-in with the persistent cache's interface (get/put by fingerprint)."""

    def __init__(self):
        self.store: dict[tuple[str, str], dict] = {}

    def get(self, fingerprint, prompts):
        return {p: self.store[(fingerprint, p)] for p in prompts if (fingerprint, p) in self.store}

    def put(self, fingerprint, encodings):
        self.store.update({(fingerprint, p): e for p, e in encodings.items()})


def _count_text_encoder_calls(adapter) -> list[int]:
    calls = [0]
    first_encoder = next(
        m for name, m in adapter.pipe.components.items() if name.startswith("text_encoder") and m is not None
    )
    first_encoder.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("case", arch_params(["sd3", "qwen_image"]))
def test_each_prompt_is_encoded_once(case, tiny_model):
    adapter = load_adapter(tiny_model(case.arch))  # own copy: the hook stays on it
    calls = _count_text_encoder_calls(adapter)
    cache = DictCache()
    engine = RolloutEngine(adapter, cache=cache, progress=False)
    cfg = config(case, num_inference_steps=2, batch_size=8)
    engine.generate(["a", "b", "a"], ["1", "2", "1"], [0, 0, 1], [1, 2, 3], cfg)
    engine.generate(["b", "c"], ["2", "3"], [0, 0], [4, 5], cfg)
    negatives = 1 if adapter.needs_negative(cfg.guidance_scale) else 0
    assert calls[0] == 3 + negatives
    # A fresh engine sharing the persistent cache encodes nothing.
    RolloutEngine(adapter, cache=cache, progress=False).encode(["a", "b", "c"], cfg)
    assert calls[0] == 3 + negatives
    # The cache key includes max_sequence_length (the encoding differs).
    engine.encode(["a"], dataclasses.replace(cfg, max_sequence_length=8))
    assert calls[0] == 4 + 2 * negatives


@pytest.mark.parametrize("case", arch_params(["sd3"]))
def test_bad_input_is_a_clear_error(case, adapters):
    _, adapter = adapters(case)
    engine = RolloutEngine(adapter, progress=False)
    with pytest.raises(ValueError, match="sde_type"):
        config(case, sde_type="ddim")
    with pytest.raises(ValueError, match="noise_level"):
        config(case, noise_level=-0.1)
    with pytest.raises(ValueError, match="batch_size"):
        config(case, batch_size=0)
    with pytest.raises(ValueError, match="num_inference_steps"):
        config(case, num_inference_steps=0)
    with pytest.raises(ValueError, match="height"):
        engine.generate([PROMPT], ["g"], [0], [1], config(case, height=63))
    with pytest.raises(ValueError, match="seeds"):
        engine.generate([PROMPT, PROMPT], ["g", "g"], [0, 1], [1], config(case))
    traj = engine.generate([PROMPT], ["g"], [0], [1], config(case, num_inference_steps=2))
    with pytest.raises(ValueError, match="window step"):
        engine.replay(traj, 5, config(case, num_inference_steps=2))


@pytest.mark.parametrize("case", arch_params(["sd3"]))
def test_too_long_prompt_warns(case, adapters, recwarn, caplog):
    _, adapter = adapters(case)
    engine = RolloutEngine(adapter, progress=False)
    engine.encode([" ".join(["word"] * 200)], config(case, max_sequence_length=16))
    messages = [str(w.message) for w in recwarn.list] + [r.getMessage() for r in caplog.records]
    assert any("16" in m for m in messages), messages
