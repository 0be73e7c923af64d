"""PolicyTrainer on the tiny SD3: direction of the update, NaN skip, exact resume, LoRA export, weight sync."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from diffrl import registry
from diffrl.algorithms.base import DiffusionAlgorithm, Needs
from diffrl.algorithms.batches import StepBatch
from diffrl.algorithms.catalog import get_algorithm, register
from diffrl.configs.rollout import SamplingConfig
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout.engine import RolloutEngine
from diffrl.engines.train.checkpoint import trainable_state
from diffrl.engines.train.setup import lr_factor
from diffrl.engines.train.trainer import PolicyTrainer
from diffrl.models.base import load_adapter

SAMPLING = SamplingConfig(num_inference_steps=3, height=32, width=32, noise_level=0.7, batch_size=4)
PROMPTS, GROUPS = ["a red cube", "a red cube", "two cats", "two cats"], ["g0", "g0", "g1", "g1"]


def _setup(path: str, algorithm=None, **cfg):
    adapter = load_adapter(path)
    engine = RolloutEngine(adapter, progress=False)
    defaults = dict(lora_rank=4, lora_alpha=8, lr=1e-2, mini_batch_prompts=1, micro_batch_size=2, seed=1)
    trainer = PolicyTrainer(
        adapter,
        algorithm or get_algorithm("flow_grpo", kl_coef=0.0, clip_ratio=0.2),
        TrainConfig(**{**defaults, **cfg}),
        SAMPLING,
        group_size=2,
    )
    return adapter, engine, trainer


def _rollout(engine, trainer, n: int = 4):
    return engine.generate(
        PROMPTS[:n], GROUPS[:n], [0, 1, 0, 1][:n], [11, 12, 13, 14][:n], SAMPLING, policy_version=trainer.policy_version
    )


def _replayed_log_probs(engine, traj) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([engine.replay(traj, j, SAMPLING).log_prob for j in range(traj.window_size)], dim=1)


def test_update_moves_log_probs_in_the_direction_of_the_advantage(tiny_model):
    _, engine, trainer = _setup(tiny_model("sd3"), mini_batch_prompts=1)
    traj = _rollout(engine, trainer, n=2)
    before = _replayed_log_probs(engine, traj)
    torch.testing.assert_close(before, traj.log_probs, atol=1e-6, rtol=0)  # replay == rollout numerics
    metrics = trainer.update(traj, torch.tensor([1.0, -1.0]), engine)
    after = _replayed_log_probs(engine, traj)
    assert (after[0] > before[0]).all(), (before, after)  # advantage +1: every trained step more likely
    assert (after[1] < before[1]).all(), (before, after)  # advantage -1: less likely
    assert metrics["rollout_corr/logprob_abs_diff_max"] <= 1e-6
    assert metrics["actor/skipped_steps"] == 0 and metrics["actor/grad_norm"] > 0
    for name in (
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/ratio_mean",
        "actor/ratio_std",
        "actor/lr",
        "timing_s/update_actor",
    ):
        assert math.isfinite(metrics[name]), name


@dataclass(frozen=True)
class Reinforce(DiffusionAlgorithm):
    """REINFORCE on denoising steps, added as docs/algorithms.md says: its settings, its needs, its loss
    (loss = scale * mean(-A log_prob) over the trained steps; no old policy, no reference)."""

    scale: float = 1.0

    @property
    def needs(self) -> Needs:
        return Needs("denoising_steps")

    def loss(self, batch: StepBatch):
        loss = self.scale * (-batch.advantages * batch.log_prob * batch.weights).mean()
        return loss, {"actor/pg_loss": loss.detach()}


@pytest.fixture
def reinforce():
    register(Reinforce("reinforce", noise_level=0.7))  # the one registry line (in algorithms/catalog.py)
    yield get_algorithm("reinforce", scale=2.0)  # a config's `algorithm: {name: reinforce, scale: 2.0}`
    registry.unregister("algorithm", "reinforce")


def test_a_new_algorithm_is_one_class_and_one_registry_line(tiny_model, reinforce):
    """The trainer trains an algorithm it has never heard of by asking it what it needs."""
    _, engine, trainer = _setup(tiny_model("sd3"), reinforce)
    traj = _rollout(engine, trainer, n=2)
    before = _replayed_log_probs(engine, traj)
    metrics = trainer.update(traj, torch.tensor([1.0, -1.0]), engine)
    after = _replayed_log_probs(engine, traj)
    assert (after[0] > before[0]).all() and (after[1] < before[1]).all(), (before, after)
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/skipped_steps"] == 0


def test_nan_gradient_skips_the_step_and_training_continues(tiny_model):
    adapter, engine, trainer = _setup(tiny_model("sd3"), mini_batch_prompts=2)
    traj = _rollout(engine, trainer)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    start = {k: v.clone() for k, v in trainable_state(trainer).items()}
    param = next(p for n, p in adapter.transformer.named_parameters() if "lora_B" in n)
    hook = param.register_hook(lambda g: g * float("nan"))
    metrics = trainer.update(traj, advantages, engine)
    hook.remove()
    assert metrics["actor/skipped_steps"] == 1 and trainer.optimizer_steps == 0
    assert all(torch.equal(start[k], v) for k, v in trainable_state(trainer).items())
    metrics = trainer.update(traj, advantages, engine)
    assert metrics["actor/skipped_steps"] == 0 and trainer.optimizer_steps == 1
    assert any(not torch.equal(start[k], v) for k, v in trainable_state(trainer).items())


@pytest.mark.parametrize("lora", [True, False])
def test_save_load_reproduces_the_next_step_exactly(tiny_model, tmp_path, lora):
    path = tiny_model("sd3")
    algorithm = get_algorithm("flow_grpo", kl_coef=0.04, clip_ratio=0.2)
    cfg = dict(lora=lora, lr=1e-3, lr_schedule="warmup_constant", warmup_steps=3)
    _, engine, trainer = _setup(path, algorithm, **cfg)
    traj = _rollout(engine, trainer)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    trainer.update(traj, advantages, engine)
    # LoRA through an fsspec URL (memory://), full fine-tuning on local disk.
    target = f"memory://ckpt_{tmp_path.name}/step_1" if lora else str(tmp_path / "step_1")
    ckpt = trainer.save_checkpoint(target, step=1)
    expected = trainer.update(traj, advantages, engine)
    expected_weights = trainable_state(trainer)

    _, engine2, resumed = _setup(path, algorithm, **cfg)
    assert resumed.load_checkpoint(ckpt) == 1
    got = resumed.update(traj, advantages, engine2)
    for name in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr", "actor/ratio_mean"):
        assert got[name] == expected[name], name
    for name, value in trainable_state(resumed).items():
        assert torch.equal(value, expected_weights[name]), name


def test_snapshot_equals_the_torch_distributed_state_dicts_and_is_a_copy(tiny_model):
    """The single-process snapshot reads parameters and optimizer state directly (fast): the same names, values and
    param groups as get_model_state_dict / get_optimizer_state_dict give, and copies that a later update leaves
    alone (the background writer writes them while the next rollout runs)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from diffrl.engines.train import checkpoint

    _, engine, trainer = _setup(tiny_model("sd3"))
    traj = _rollout(engine, trainer)
    trainer.update(traj, torch.tensor([1.0, -1.0, 0.5, -0.5]), engine)
    snap = checkpoint.snapshot(trainer, step=1)
    reference = {k: v.clone() for k, v in trainable_state(trainer, all_lora=True).items()}  # views on the CPU
    assert sorted(snap.trainable) == sorted(reference)
    assert all(torch.equal(snap.trainable[k], v) for k, v in reference.items())
    tensors, groups = checkpoint._split_optimizer(
        get_optimizer_state_dict(trainer.adapter.transformer, trainer.optimizer, options=checkpoint._FULL)
    )
    assert sorted(snap.optimizer) == sorted(tensors) and groups == snap.optimizer_groups
    assert all(torch.equal(snap.optimizer[k], v) for k, v in tensors.items())
    trainer.update(traj, torch.tensor([1.0, -1.0, 0.5, -0.5]), engine)
    moved = trainable_state(trainer, all_lora=True)
    assert any(not torch.equal(snap.trainable[k], moved[k]) for k in moved)  # the live weights moved on...
    assert all(torch.equal(snap.trainable[k], v) for k, v in reference.items())  # ...the snapshot did not


def test_lora_checkpoint_loads_into_the_diffusers_pipeline(tiny_model, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    path = tiny_model("sd3")
    adapter, engine, trainer = _setup(path)
    traj = _rollout(engine, trainer)
    trainer.update(traj, torch.tensor([1.0, -1.0, 0.5, -0.5]), engine)
    lora_dir = trainer.export_lora(str(tmp_path / "lora"))

    pipe = StableDiffusion3Pipeline.from_pretrained(path)
    kwargs = dict(prompt="a red cube", num_inference_steps=2, height=32, width=32, output_type="np")
    base = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    pipe.load_lora_weights(lora_dir)
    tuned = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    assert abs(tuned - base).max() > 1e-4  # the LoRA changes the output
    # ... and the loaded LoRA (rank, alpha, targets from the file's metadata) is exactly our policy.
    x = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    inputs = dict(
        hidden_states=x,
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, 7, pipe.transformer.config.joint_attention_dim),
        pooled_projections=torch.randn(1, pipe.transformer.config.pooled_projection_dim),
    )
    with torch.no_grad():
        ours = adapter.transformer(**inputs).sample
        theirs = pipe.transformer(**inputs).sample
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_split_weight_sync_copies_only_changed_lora_tensors(tiny_model):
    path = tiny_model("sd3")
    _, engine, trainer = _setup(path)
    rollout = RolloutEngine(load_adapter(path), progress=False)  # its own copy of the model ("split")
    traj = _rollout(engine, trainer)
    trainer.update(traj, torch.tensor([1.0, -1.0, 0.5, -0.5]), engine)
    first = trainer.sync_weights(rollout)
    assert first["sync/num_tensors"] > 0 and trainer.policy_version == 1 and first["timing_s/sync_weights"] >= 0
    synced = _rollout(rollout, trainer)
    torch.testing.assert_close(synced.log_probs, _replayed_log_probs(engine, synced), atol=1e-6, rtol=0)
    assert trainer.sync_weights(rollout)["sync/num_tensors"] == 0  # nothing changed since
    colocated = trainer.sync_weights(engine)
    assert colocated["sync/num_tensors"] == 0 and trainer.policy_version == 3


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="lr_schedule"):
        TrainConfig(lr_schedule="linear")
    with pytest.raises(ValueError, match="rollout_correction"):
        TrainConfig(rollout_correction="always")
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match="total_steps"):
        TrainConfig(lr_schedule="warmup_cosine", warmup_steps=10, total_steps=5)


def test_lr_schedule_closed_form():
    cfg = TrainConfig(lr_schedule="warmup_cosine", warmup_steps=3, total_steps=13)
    assert [lr_factor(s, cfg) for s in range(3)] == [0.25, 0.5, 0.75]
    assert lr_factor(3, cfg) == 1.0 and abs(lr_factor(8, cfg) - 0.5) < 1e-12 and lr_factor(13, cfg) < 1e-12
    assert lr_factor(100, TrainConfig()) == 1.0


def test_rollout_correction_weights_closed_form():
    from diffrl.engines.train.policy_loss import correction_weights

    old, rollout = torch.tensor([0.0, 1.0, -1.0, 0.1]), torch.tensor([0.0, 0.0, 0.0, 0.0])
    assert correction_weights(old, rollout, TrainConfig()) is None
    tis = correction_weights(old, rollout, TrainConfig(rollout_correction="tis", is_cap=2.0))
    torch.testing.assert_close(tis, torch.tensor([1.0, 2.0, math.exp(-1.0), math.exp(0.1)]))
    mask = correction_weights(old, rollout, TrainConfig(rollout_correction="mask", rs_threshold=2.0))
    assert mask.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_recomputed_old_log_probs_match_the_rollout_and_feed_the_correction(tiny_model):
    # Rollout on a separate engine object ("not in-process numerics" as far as the trainer knows).
    adapter, _, trainer = _setup(tiny_model("sd3"), old_log_probs="recompute", rollout_correction="tis")
    traj = _rollout(RolloutEngine(adapter, progress=False), trainer, n=2)
    metrics = trainer.update(traj, torch.tensor([1.0, -1.0]))
    assert metrics["rollout_corr/logprob_abs_diff_max"] <= 1e-6  # same numerics, measured
    assert abs(metrics["actor/ratio_mean"] - 1.0) <= 1e-5 and trainer.optimizer_steps == 1


def test_pass_metrics_accumulate_on_device_and_read_once():
    """Per-pass metrics stay tensors until the update's end (no host sync per pass); the means equal per-pass float
    sums on the host, bit for bit (float64 sums of the float32 values, in the same order)."""
    from collections import defaultdict

    from diffrl.engines.train.trainer import _accumulate, _reduce_metrics

    values = torch.rand(7, generator=torch.Generator().manual_seed(0)) * 1e-3
    sums, counts = defaultdict(float), defaultdict(int)
    for v in values:
        _accumulate(sums, counts, {"actor/pg_loss": v.reshape(()), "actor/lr_like": 0.5})
    assert torch.is_tensor(sums["actor/pg_loss"]) and sums["actor/pg_loss"].dtype == torch.float64
    expected = 0.0
    for v in values:
        expected += float(v)
    reduced = _reduce_metrics(sums, counts)
    assert reduced["actor/pg_loss"] == expected / 7 and isinstance(reduced["actor/pg_loss"], float)
    assert reduced["actor/lr_like"] == 0.5
