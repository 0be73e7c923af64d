"""Starting from another run's weights (diffrl/engines/train/warm_start.py) and resuming with another learning rate
(setup.apply_optimizer_config), on the tiny SD3."""

from __future__ import annotations

import pytest
import torch
from test_trainer import _setup

from diffrl.algorithms.catalog import get_algorithm
from diffrl.engines.train.checkpoint import trainable_state
from diffrl.engines.train.setup import lr_factor
from diffrl.engines.train.warm_start import load_weights


def _trained_checkpoint(path: str, folder, **cfg) -> tuple[str, dict]:
    """A checkpoint after one optimizer step on seeded random gradients (weights and Adam moments that no new
    trainer has; no rollout needed), and its trained weights."""
    _, _, trainer = _setup(path, **cfg)
    generator = torch.Generator().manual_seed(0)
    for p in trainer.params:
        p.grad = torch.randn(p.shape, generator=generator)
    trainer.optimizer.step()
    trainer.scheduler.step()
    return trainer.save_checkpoint(str(folder / "step_1"), step=1), trainable_state(trainer)


@pytest.mark.parametrize("lora", [True, False])
def test_the_weights_load_and_the_optimizer_stays_new(tiny_model, tmp_path, lora):
    path = tiny_model("sd3")
    ckpt, trained = _trained_checkpoint(path, tmp_path, lora=lora)
    _, _, warm = _setup(path, lora=lora)
    load_weights(warm, ckpt)
    state = trainable_state(warm)
    assert sorted(state) == sorted(trained) and all(torch.equal(state[k], v) for k, v in trained.items())
    assert warm.optimizer_steps == 0 and not warm.optimizer.state and warm.scheduler.last_epoch == 0


def test_another_lora_rank_is_refused_by_tensor_before_any_weight_changes(tiny_model, tmp_path):
    path = tiny_model("sd3")
    ckpt, _ = _trained_checkpoint(path, tmp_path)  # rank 4
    _, _, other = _setup(path, lora_rank=2)
    before = trainable_state(other)
    refused = r"run.init_from: checkpoint .* holds \S+lora_A\S+ in shape \(4, \d+\), this run trains it in shape \(2,"
    with pytest.raises(ValueError, match=refused):
        load_weights(other, ckpt)
    assert all(torch.equal(v, before[k]) for k, v in trainable_state(other).items())


def test_a_resume_trains_at_the_configs_learning_rate_not_the_checkpoints(tiny_model, tmp_path):
    """The optimizer's state dict restores the lr (and LambdaLR's base lrs) it was saved with."""
    path = tiny_model("sd3")
    schedule = dict(lr_schedule="warmup_constant", warmup_steps=3)
    ckpt, _ = _trained_checkpoint(path, tmp_path, lr=1e-3, weight_decay=0.0, **schedule)
    _, _, resumed = _setup(path, lr=5e-3, weight_decay=0.1, **schedule)
    resumed.load_checkpoint(ckpt)
    [group] = resumed.optimizer.param_groups
    want = 5e-3 * lr_factor(1, resumed.cfg)  # one optimizer step done: the schedule goes on from there
    assert group["lr"] == want and resumed.scheduler.get_last_lr() == [want] and group["weight_decay"] == 0.1
    resumed.optimizer.step()
    resumed.scheduler.step()
    assert resumed.scheduler.get_last_lr() == [5e-3 * lr_factor(2, resumed.cfg)]


def test_nft_s_old_adapter_starts_as_the_loaded_policy(tiny_model, tmp_path):
    path = tiny_model("sd3")
    ckpt, _ = _trained_checkpoint(path, tmp_path)
    _, _, warm = _setup(path, get_algorithm("diffusion_nft"))
    load_weights(warm, ckpt)
    params = dict(warm.adapter.transformer.named_parameters())
    pairs = [(n, n.replace(".default.", ".old.")) for n in params if ".default." in n and "lora_" in n]
    assert pairs and all(torch.equal(params[new], params[old]) for new, old in pairs)
