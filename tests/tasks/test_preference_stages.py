"""Direct-preference stages: which rows each algorithm trains on, and DiffusionNFT's rollout with the old adapter."""

from __future__ import annotations

import os

import pytest
import torch

from diffrl.algorithms.catalog import get_algorithm
from diffrl.configs.schema import load_experiment
from diffrl.engines import cluster
from diffrl.engines.step.generate import generate
from diffrl.engines.step.plan import chunk_plan
from diffrl.engines.step.update import training_rows
from diffrl.engines.train.preference import lora_pairs
from diffrl.flows.build import build_engines
from diffrl.flows.build_preference import check_preference_config

TEST_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")  # configs for tests only
GROUPS = ["a", "a", "a", "b", "b", "c", "c"]
REWARDS = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.3, 0.2, 0.7])


def test_dpo_trains_on_the_best_and_worst_valid_sample_of_each_group():
    valid = torch.tensor([True, False, True, True, True, True, True])  # sample 1 (the best of "a") is excluded
    advantages = REWARDS - 0.4
    rows, stats = training_rows(get_algorithm("dpo"), REWARDS, advantages, GROUPS, valid)
    assert rows == [2, 0, 6, 5]  # "b" ties and is skipped; chosen before rejected
    assert stats["dp/num_pairs"] == 2
    assert stats["dp/chosen_reward"] == torch.tensor([0.5, 0.7]).mean().item()
    assert stats["dp/rejected_reward"] == torch.tensor([0.1, 0.2]).mean().item()


def test_nft_and_awm_train_on_every_valid_sample():
    valid = torch.tensor([True, True, False, True, True, True, True])
    for name in ("diffusion_nft", "awm"):
        rows, stats = training_rows(get_algorithm(name), REWARDS, REWARDS, GROUPS, valid)
        assert rows == [0, 1, 3, 4, 5, 6] and stats == {"dp/num_samples": 6.0}


def test_nft_rollout_samples_with_the_old_adapter(tmp_path, tiny_model):
    cfg = load_experiment(
        os.path.join(TEST_CONFIGS, "quick_nft.yaml"),
        [
            f"model.path={tiny_model('sd3')}",
            f"run.root={tmp_path}/runs",
            "run.name=nft_old",
            "rollout.num_inference_steps=2",
            "rollout.height=32",
            "rollout.width=32",
            "rollout.group_size=2",
            "rollout.prompts_per_step=2",
            "rollout.chunk_size=4",
            "train.mini_batch_prompts=2",
            "algorithm.window={kind: random_start, size: 1, start_range: [1, 2]}",
            "data.num_generated=8",
        ],
    )
    engines = build_engines(cfg)
    try:
        with torch.no_grad():  # move the policy away from the old adapter (as training does)
            gen = torch.Generator().manual_seed(0)
            for new, _ in lora_pairs(engines.adapter.transformer):
                new.add_(0.5 * torch.randn(new.shape, generator=gen))
        generate(engines, 0, 0)
        engines.memory.drain()  # the held rows land
        stored = engines.store.read_chunk(0, 0)
        plan = chunk_plan(engines, 0, 0)
        args = (
            [r.prompt for r in plan["records"]],
            [r.uid for r in plan["records"]],
            plan["sample_index"],
            plan["seeds"],
            cfg.sampling,
        )
        with engines.trainer.old_policy():
            old = engines.rollout.generate(*args)
        current = engines.rollout.generate(*args)
        assert torch.equal(stored.latents, old.latents)
        assert not torch.allclose(stored.latents, current.latents, atol=1e-3)
        trainable = {n for n, p in engines.adapter.transformer.named_parameters() if p.requires_grad}
        assert trainable and all(".default." in n for n in trainable)  # back on the trained adapter
    finally:
        cluster.drop(cfg.run.name)


def test_direct_preference_window_must_end_at_the_last_step():
    """A window ending at the last step trains (size 1, or longer: SDE sampling on the earlier steps too)."""
    base = ["algorithm.name=dpo", "rollout.num_inference_steps=4"]
    for window in (
        "{kind: random_start, size: 1, start_range: [3, 4]}",
        "{kind: random_start, size: 4, start_range: [0, 1]}",
    ):
        check_preference_config(
            load_experiment(os.path.join(TEST_CONFIGS, "quick_dpo.yaml"), [*base, f"algorithm.window={window}"])
        )
    for window in (
        "{kind: random_start, size: 2, start_range: [1, 2]}",  # ends at step 2
        "{kind: random_start, size: 1, start_range: [2, 4]}",  # may end at step 2
        "{kind: all_but_last, size: 2, start_range: [0, 4]}",
    ):
        with pytest.raises(ValueError, match="window must end at the last denoising step"):
            check_preference_config(
                load_experiment(os.path.join(TEST_CONFIGS, "quick_dpo.yaml"), [*base, f"algorithm.window={window}"])
            )
