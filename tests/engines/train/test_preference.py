"""The trainer on final samples (tiny SD3): DPO prefers the chosen sample; DiffusionNFT's old adapter is an EMA."""

from __future__ import annotations

import pytest
import torch

from diffrl.algorithms.catalog import get_algorithm
from diffrl.algorithms.gspo import GSPO
from diffrl.algorithms.windows import WindowPolicy
from diffrl.configs.rollout import SamplingConfig
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout.engine import RolloutEngine
from diffrl.engines.train.preference import lora_pairs, preference_pairs
from diffrl.engines.train.trainer import PolicyTrainer
from diffrl.models.base import SampleShape, load_adapter

# Direct preference trains on final samples: the window is the last step (ODE rollout, noise level 0).
SAMPLING = SamplingConfig(
    num_inference_steps=3,
    height=32,
    width=32,
    noise_level=0.0,
    batch_size=4,
    window=WindowPolicy("random_start", size=1, start_range=(2, 3)),
)
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5])


def _setup(path, algorithm):
    adapter = load_adapter(path)
    engine = RolloutEngine(adapter, progress=False)
    trainer = PolicyTrainer(
        adapter,
        algorithm,
        TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2, mini_batch_prompts=2, micro_batch_size=2),
        SAMPLING,
        group_size=2,
    )
    traj = engine.generate(
        ["a cat", "a cat", "a dog", "a dog"], ["0", "0", "1", "1"], [0, 1, 0, 1], [1, 2, 3, 4], SAMPLING
    )
    return adapter, engine, trainer, traj


def test_preference_pairs_pick_best_and_worst_of_each_group():
    assert preference_pairs(torch.tensor([0.1, 0.9, -0.5, 0.0, 0.0]), ["a", "a", "a", "b", "b"]) == [(1, 2)]


def test_dpo_update_prefers_the_chosen_sample(tiny_model):
    _, engine, trainer, traj = _setup(tiny_model("sd3"), get_algorithm("dpo"))
    first = trainer.update(traj, ADVANTAGES, engine)
    second = trainer.update(traj, ADVANTAGES, engine)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any step
    assert second["rewards/margins"] > 0 and second["actor/dpo_loss"] < first["actor/dpo_loss"]


def test_diffusion_nft_old_adapter_is_an_ema_of_the_policy(tiny_model):
    algorithm = get_algorithm("diffusion_nft", old_policy_decay_ramp=0.25)
    adapter, engine, trainer, traj = _setup(tiny_model("sd3"), algorithm)
    trainer.update(traj, ADVANTAGES, engine)  # decay(1) = 0.25
    old_before = [old.detach().clone() for _, old in lora_pairs(adapter.transformer)]
    trainer.update(traj, ADVANTAGES, engine)  # decay(2) = 0.5
    decay = algorithm.old_adapter_decay(2)
    assert decay == 0.5
    for (new, old), prev in zip(lora_pairs(adapter.transformer), old_before):
        torch.testing.assert_close(old, decay * prev + (1 - decay) * new.detach())
    assert any(not torch.equal(new, old) for new, old in lora_pairs(adapter.transformer))


def test_token_algorithm_is_rejected(tiny_model):
    """One trainer trains every diffusion algorithm; one that trains on tokens needs an autoregressive trainer."""
    with pytest.raises(ValueError, match="trains on tokens; PolicyTrainer trains a diffusion model"):
        PolicyTrainer(load_adapter(tiny_model("sd3")), GSPO("gspo"), TrainConfig(), SAMPLING, group_size=2)


def test_each_ppo_epoch_trains_a_sample_at_new_noise(tiny_model):
    """The noise key has the epoch in it, and it alone: same (update, epoch) -> the same draw, as on every rank."""
    _, _, trainer, traj = _setup(tiny_model("sd3"), get_algorithm("diffusion_nft"))
    x0, seeds = traj.latents[:, -1], torch.as_tensor(traj.seeds)
    sigmas_N = trainer.adapter.sigmas(SAMPLING.num_inference_steps, SampleShape(32, 32)).float().cpu()
    first = trainer._noised(x0, seeds, sigmas_N, epoch=0)
    again = trainer._noised(x0, seeds, sigmas_N, epoch=0)
    second = trainer._noised(x0, seeds, sigmas_N, epoch=1)
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b)
    assert not torch.equal(first[1], second[1])  # new noise in epoch 1
    for sigma, x_t, target in (first, second):  # x_t on the flow-matching line, target noise - x0
        s = sigma.reshape(-1, *[1] * (x0.ndim - 1))
        torch.testing.assert_close(x_t, (1 - s) * x0 + s * (target + x0))
