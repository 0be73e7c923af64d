"""Validation with several images per prompt (`data.val_samples_per_prompt`, GenEval's 4 per prompt): which
seeds each copy gets, that copy 0 reproduces a one-image validation's images exactly, and validation_rollout (the
flow's and benchmarks/shapes_rl.py's validation) is that ODE sampling."""

from __future__ import annotations

import dataclasses
import os

import torch

from diffrl.configs.schema import load_experiment
from diffrl.engines.rollout import RolloutEngine
from diffrl.engines.step.plan import validation_batch, validation_rollout
from diffrl.engines.store.prompts import PromptDataset
from diffrl.models.base import load_adapter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES_SMALL = os.path.join(REPO, "diffrl", "models", "reference", "shapes-small")
HELDOUT = PromptDataset.load(os.path.join(REPO, "diffrl", "data", "shapes_heldout.jsonl"))


def test_copies_get_new_seeds_and_copy_zero_keeps_the_one_image_seeds():
    records = [HELDOUT[i] for i in range(5)]
    one, three = validation_batch(records, run_seed=2), validation_batch(records, run_seed=2, copies=3)
    assert one["seeds"] == [9, 10, 11, 12, 13]  # run seed + 7 + i
    assert three["seeds"] == [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # + c * 5: all distinct
    assert three["sample_index"] == [0] * 5 + [1] * 5 + [2] * 5
    assert three["prompts"] == [r.prompt for r in records] * 3
    assert three["group_ids"] == [r.uid for r in records] * 3
    assert [m["ground_truth"] for m in three["metadata"]] == [r.ground_truth for r in records] * 3
    assert {k: v[:5] for k, v in three.items()} == one


def test_two_images_per_prompt_repeat_the_one_image_validation_then_add_new_samples():
    cfg = load_experiment("quickstart", [])
    rollout = RolloutEngine(load_adapter(SHAPES_SMALL), progress=False)
    records = [HELDOUT[i] for i in range(3)]
    # ODE as validation samples; chunks of 3 so the first chunk of six is the three-sample batch itself
    ode = dataclasses.replace(cfg.sampling, noise_level=0.0, batch_size=3)
    one = rollout.generate(cfg=ode, **validation_batch(records, cfg.run.seed))
    two = rollout.generate(cfg=ode, **validation_batch(records, cfg.run.seed, copies=2))
    assert two.images.shape[0] == 6
    assert torch.equal(two.images[:3], one.images)  # same seeds, same images
    assert not torch.equal(two.images[3:], one.images)  # the second copies are new samples


def test_validation_rollout_samples_the_ode_copies_and_takes_fewer_steps_than_the_window():
    """The config's sampling at noise 0 on validation_batch's copies; overriding num_inference_steps below the
    SDE window's 4 steps cuts the window instead of failing ("WindowPolicy.size 4 > num_steps 2")."""
    cfg = load_experiment("quickstart", ["data.val_samples_per_prompt=2"])
    rollout = RolloutEngine(load_adapter(SHAPES_SMALL), progress=False)
    records = [HELDOUT[i] for i in range(3)]
    traj = validation_rollout(rollout, cfg, records, step=5)
    by_hand = rollout.generate(
        cfg=dataclasses.replace(cfg.sampling, noise_level=0.0), **validation_batch(records, cfg.run.seed, copies=2)
    )
    assert traj.images.shape[0] == 6 and torch.equal(traj.images, by_hand.images)
    assert traj.prompts == [r.prompt for r in records] * 2
    two_steps = validation_rollout(rollout, cfg, records, num_inference_steps=2)
    assert two_steps.images.shape == traj.images.shape and not torch.equal(two_steps.images, traj.images)
