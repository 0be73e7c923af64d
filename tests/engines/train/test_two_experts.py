"""PolicyTrainer on the tiny two-expert Wan2.2 ("wan22"): a LoRA on each expert, each trained step's gradient reaching
the expert the rollout routed it to, one optimizer over both, exact resume, and the LoRA files diffusers loads."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from diffusers import WanPipeline
from safetensors.torch import load_file

from diffrl.algorithms.catalog import get_algorithm
from diffrl.algorithms.windows import WindowPolicy
from diffrl.configs.rollout import SamplingConfig
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout.engine import RolloutEngine
from diffrl.engines.step.retention import checkpoint_bytes
from diffrl.engines.train.checkpoint import lora_file_name, trainable_state
from diffrl.engines.train.export import export_checkpoint
from diffrl.engines.train.trainer import PolicyTrainer
from diffrl.models.base import load_adapter

# 4 steps of the shift-12 schedule: timesteps ~1000, 960 (high-noise expert) then ~857, ~12 (low-noise, boundary 875)
SAMPLING = SamplingConfig(
    num_inference_steps=4, height=16, width=16, num_frames=5, noise_level=0.7, batch_size=4, max_sequence_length=16
)
PROMPTS, GROUPS = ["a red cube", "a red cube", "two cats", "two cats"], ["g0", "g0", "g1", "g1"]
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5])


def _setup(path: str, **cfg):
    adapter = load_adapter(path)
    engine = RolloutEngine(adapter, progress=False)
    defaults = dict(lora_rank=4, lora_alpha=8, lr=1e-3, mini_batch_prompts=2, micro_batch_size=2, seed=1)
    algorithm = get_algorithm("flow_grpo", kl_coef=0.04, clip_ratio=0.2)
    trainer = PolicyTrainer(adapter, algorithm, TrainConfig(**{**defaults, **cfg}), SAMPLING, group_size=2)
    return adapter, engine, trainer


def _rollout(engine, trainer, window: WindowPolicy | None = None):
    sampling = SAMPLING if window is None else _with_window(window)
    return engine.generate(PROMPTS, GROUPS, [0, 1, 0, 1], [11, 12, 13, 14], sampling, policy_version=0)


def _with_window(window: WindowPolicy) -> SamplingConfig:
    import dataclasses

    return dataclasses.replace(SAMPLING, window=window)


def _experts_of_steps(adapter) -> list[int]:
    """The expert (0 high-noise, 1 low-noise) of each of the 4 denoising steps, by the adapter's own routing."""
    sigmas = adapter.sigmas(SAMPLING.num_inference_steps, None)[:-1]
    return adapter._expert_index(sigmas * adapter.pipe.scheduler.config.num_train_timesteps).tolist()


def _expert_state(trainer) -> dict[str, dict[str, torch.Tensor]]:
    state = trainable_state(trainer)
    experts = ("transformer", "transformer_2")
    return {e: {k: v.clone() for k, v in state.items() if k.startswith(e + ".")} for e in experts}


@pytest.fixture(scope="module")
def path22(tiny_model):
    return tiny_model("wan22")


def test_replayed_log_probs_equal_the_rollout_on_both_sides_of_the_boundary(path22):
    adapter, engine, trainer = _setup(path22)
    assert _experts_of_steps(adapter) == [0, 0, 1, 1]
    traj = _rollout(engine, trainer)  # all_but_last: steps 0, 1 (high-noise) and 2 (low-noise)
    with torch.no_grad():
        replayed = torch.stack([engine.replay(traj, j, SAMPLING).log_prob for j in range(traj.window_size)], dim=1)
    assert traj.step_indices[0].tolist() == [0, 1, 2]
    torch.testing.assert_close(replayed, traj.log_probs, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "start,size,changed",
    [(0, 2, {"transformer"}), (2, 1, {"transformer_2"}), (1, 2, {"transformer", "transformer_2"})],
)
def test_an_update_changes_only_the_experts_of_the_trained_steps(path22, start, size, changed):
    _, engine, trainer = _setup(path22)
    traj = _rollout(engine, trainer, WindowPolicy("random_start", size=size, start_range=(start, start + 1)))
    before = _expert_state(trainer)
    assert all(before.values()), "both experts carry LoRA tensors"
    metrics = trainer.update(traj, ADVANTAGES, engine)
    assert metrics["actor/skipped_steps"] == 0 and trainer.optimizer_steps == 1
    after = _expert_state(trainer)
    moved = {e for e in before if any(not torch.equal(before[e][k], after[e][k]) for k in before[e])}
    assert moved == changed


def test_checkpoint_resume_and_export_hold_both_experts(path22, tmp_path):
    _, engine, trainer = _setup(path22)
    traj = _rollout(engine, trainer)
    trainer.update(traj, ADVANTAGES, engine)
    ckpt = trainer.save_checkpoint(str(tmp_path / "step_1"), step=1)
    assert sorted(os.listdir(os.path.join(ckpt, "lora"))) == sorted(
        [lora_file_name("transformer"), lora_file_name("transformer_2")]
    )
    # the disk estimate counts both experts' LoRA and moments: the tensor bytes the checkpoint holds, less the RNG
    # state and AdamW's step counts (at this size the files' headers outweigh the tensors, so bytes on disk won't do)
    files = [os.path.join(d, f) for d, _, names in os.walk(ckpt) for f in names if f.endswith(".safetensors")]
    held = sum(t.numel() * t.element_size() for f in files if "rng" not in f for t in load_file(f).values())
    assert 0.98 * held <= checkpoint_bytes(SimpleNamespace(trainer=trainer)) <= held
    expected = trainer.update(traj, ADVANTAGES, engine)
    expected_weights = trainable_state(trainer)

    _, engine2, resumed = _setup(path22)
    assert resumed.load_checkpoint(ckpt) == 1
    got = resumed.update(traj, ADVANTAGES, engine2)
    for name in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ratio_mean"):
        assert got[name] == expected[name], name
    assert {k.split(".")[0] for k in expected_weights} == {"transformer", "transformer_2"}
    for name, value in trainable_state(resumed).items():
        assert torch.equal(value, expected_weights[name]), name

    # `diffrl export` of the checkpoint: both experts' LoRA files, merged into the pipeline as trained at step 1
    done = export_checkpoint(str(ckpt), str(tmp_path / "out"), base_model=path22, merge=True, say=lambda _: None)
    assert done.lora_file_2 is not None and os.path.isfile(done.lora_file_2)
    merged = WanPipeline.from_pretrained(done.pipeline_dir)
    _, _, at_step_1 = _setup(path22)
    at_step_1.load_checkpoint(ckpt)
    for name in ("transformer", "transformer_2"):
        ours, theirs = _expert_outputs(getattr(at_step_1.adapter.pipe, name), getattr(merged, name))
        torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def _expert_outputs(ours_model, theirs_model) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 2, 4, 4, generator=gen),
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, 16, 32, generator=gen),
        return_dict=False,
    )
    with torch.no_grad():
        return ours_model(**inputs)[0], theirs_model(**inputs)[0]


def test_exported_lora_loads_into_the_diffusers_pipeline_for_both_experts(path22, tmp_path):
    adapter, engine, trainer = _setup(path22)
    trainer.update(_rollout(engine, trainer), ADVANTAGES, engine)
    lora_dir = trainer.export_lora(str(tmp_path / "lora"))

    pipe = WanPipeline.from_pretrained(path22)
    base = [_expert_outputs(getattr(adapter.pipe, n), getattr(pipe, n)) for n in ("transformer", "transformer_2")]
    pipe.load_lora_weights(lora_dir)  # diffusers' way: the high-noise file, then the low-noise one into transformer_2
    pipe.load_lora_weights(lora_dir, weight_name=lora_file_name("transformer_2"), load_into_transformer_2=True)
    for (ours_before, base_out), name in zip(base, ("transformer", "transformer_2")):
        assert (ours_before - base_out).abs().max() > 1e-6  # the trained LoRA changes this expert
        ours, theirs = _expert_outputs(getattr(adapter.pipe, name), getattr(pipe, name))
        torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_full_fine_tuning_with_a_reference_of_two_experts_is_refused(path22):
    with pytest.raises(ValueError, match="lora: true"):
        _setup(path22, lora=False, param_dtype="fp32")
