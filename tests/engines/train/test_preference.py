"""The trainer on final samples (tiny SD3): DPO prefers the chosen sample; DiffusionNFT's old adapter is an EMA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffrl.algorithms.catalog import get_algorithm
from diffrl.algorithms.gspo import GSPO
from diffrl.algorithms.windows import WindowPolicy
from diffrl.configs.rollout import SamplingConfig
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout.engine import RolloutEngine
from diffrl.engines.train.preference import (
    lora_pairs,
    noised_samples,
    preference_pairs,
    training_sigmas,
    training_units,
    whole_groups,
)
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


def test_a_group_algorithm_trains_whole_groups_that_share_their_noise(tiny_model):
    """DGPO (Needs.groups): a micro-batch holds whole groups, numbered by group_index, each on one noise and sigma."""
    assert whole_groups(["b", "a", "b", "a", "c"]) == [[0, 2], [1, 3], [4]]
    assert training_units(ADVANTAGES, ["0", "0", "1", "1"], pairs=False, groups=True) == [[0, 1], [2, 3]]
    _, engine, trainer, traj = _setup(tiny_model("sd3"), get_algorithm("dgpo"))
    sigmas_N = trainer.adapter.sigmas(SAMPLING.num_inference_steps, SampleShape(32, 32)).float().cpu()
    batch = trainer._sample_batch(traj, [[0, 1], [2, 3]], ADVANTAGES, engine, sigmas_N, SampleShape(32, 32), 0)
    assert batch.group_index.tolist() == [0, 0, 1, 1]
    noise = batch.target + batch.x0
    for a, b in ((0, 1), (2, 3)):
        assert batch.sigma[a] == batch.sigma[b]
        torch.testing.assert_close(noise[a], noise[b])  # target = noise - x0, rounded in fp32
    assert (noise[0] - noise[2]).abs().max() > 0.1
    first = trainer.update(traj, ADVANTAGES, engine)
    # before any step the policy is the reference: every group's preference is sigmoid(0)
    assert first["actor/group_weight"] == pytest.approx(0.5) and first["actor/skipped_steps"] == 0


def test_the_timestep_clip_draws_only_the_highest_noise_levels():
    """DGPO's train_sigma_steps k (Needs.highest_sigmas): sigmas from the schedule's first k only; 0 or k >= N: all."""
    sigmas_N = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    torch.testing.assert_close(training_sigmas(sigmas_N, 2), torch.tensor([1.0, 0.75, 0.0]))
    assert training_sigmas(sigmas_N, 0) is sigmas_N and training_sigmas(sigmas_N, 4) is sigmas_N
    drawn, _, _ = noised_samples(torch.zeros(64, 2), torch.arange(64), training_sigmas(sigmas_N, 2), key=5)
    assert set(drawn.tolist()) == {1.0, 0.75}
    assert get_algorithm("dgpo").needs.highest_sigmas == 7 and get_algorithm("dpo").needs.highest_sigmas == 0


def test_gardo_kl_reference_is_the_old_adapter_reset_every_k_updates(tiny_model):
    """Needs.moving_reference: the KL's reference forward runs the "old" adapter, a copy of the policy taken every
    reference_reset_every updates; in the update right after a copy the first pass's KL is exactly 0."""
    sde = dataclasses.replace(SAMPLING, num_inference_steps=2, noise_level=0.7, window=WindowPolicy("all_but_last"))
    kl = {}
    for every in (1, 2):
        adapter = load_adapter(tiny_model("sd3"))
        engine = RolloutEngine(adapter, progress=False)
        config = TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2, mini_batch_prompts=2, micro_batch_size=4)
        trainer = PolicyTrainer(adapter, get_algorithm("gardo", reference_reset_every=every), config, sde, group_size=2)
        traj = engine.generate(
            ["a cat", "a cat", "a dog", "a dog"], ["0", "0", "1", "1"], [0, 1, 0, 1], [1, 2, 3, 4], sde
        )
        trainer.update(traj, ADVANTAGES, engine)
        kl[every] = trainer.update(traj, ADVANTAGES, engine)["actor/kl_loss"]
    assert kl[1] == 0.0 and kl[2] > 0.0


def test_an_ema_reference_is_the_closed_form_ema_of_the_policy_lora(tiny_model):
    """reference: ema keeps the KL's reference in the "old" adapter: after n updates with decays d_k it is
    prod(d) p_0 + sum_k (1 - d_k) prod_{j > k} d_j p_k, p_k the policy's LoRA tensors after update k (p_0 the initial
    ones); a velocity-space KL trains through it."""
    sde = dataclasses.replace(SAMPLING, num_inference_steps=2, noise_level=0.7, window=WindowPolicy("all_but_last"))
    algorithm = get_algorithm(
        "flow_grpo", reference="ema", reference_decay=0.6, reference_decay_ramp=0.25, kl_space="velocity"
    )
    adapter = load_adapter(tiny_model("sd3"))
    engine = RolloutEngine(adapter, progress=False)
    config = TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2, mini_batch_prompts=2, micro_batch_size=4)
    trainer = PolicyTrainer(adapter, algorithm, config, sde, group_size=2)
    traj = engine.generate(["a cat", "a cat", "a dog", "a dog"], ["0", "0", "1", "1"], [0, 1, 0, 1], [1, 2, 3, 4], sde)
    policies = [[new.detach().clone() for new, _ in lora_pairs(adapter.transformer)]]
    kl = []
    for _ in range(3):
        kl.append(trainer.update(traj, ADVANTAGES, engine)["actor/kl_loss"])
        policies.append([new.detach().clone() for new, _ in lora_pairs(adapter.transformer)])
    decays = [algorithm.old_adapter_decay(k) for k in (1, 2, 3)]
    assert decays == [0.25, 0.5, 0.6]
    expected = policies[0]
    for decay, policy in zip(decays, policies[1:]):
        expected = [decay * e + (1 - decay) * p for e, p in zip(expected, policy)]
    for (_, old), want in zip(lora_pairs(adapter.transformer), expected):
        torch.testing.assert_close(old, want)
    assert kl[0] == 0.0 and kl[1] > 0.0  # the reference starts as the policy, then lags it


def test_an_algorithm_that_draws_its_sigmas_gets_them_from_its_own_density():
    """Needs.draws_sigmas (SFT): each sample's sigma is algorithm.draw_sigma(its generator), off the sampling
    schedule; x_t and the target follow the forward process at that sigma."""
    sft = get_algorithm("sft")
    x0 = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    sigmas_N = torch.tensor([1.0, 0.5, 0.0])
    sigma, x_t, target = noised_samples(x0, torch.arange(6), sigmas_N, key=9, draw_sigma=sft.draw_sigma)
    for i in range(6):
        gen = torch.Generator().manual_seed(9 + i)
        s = torch.sigmoid(torch.randn((), generator=gen))  # logit-normal (0, 1)
        noise = torch.randn(3, generator=gen)
        assert sigma[i] == s
        torch.testing.assert_close(x_t[i], (1 - s) * x0[i] + s * noise)
        torch.testing.assert_close(target[i], noise - x0[i])
    assert not set(sigma.tolist()) & {1.0, 0.5}
