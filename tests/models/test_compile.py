"""model.compile: the denoiser's transformer blocks torch.compiled in place (ModelAdapter.compile_blocks).

The speed is measured on the GPU (benchmarks/sampler_vs_diffusers.py --compile); here: which modules are
compiled, that sampling gives the same trajectories, and that a LoRA trainer still trains through them.
"""

from __future__ import annotations

import torch

from diffrl.algorithms.catalog import get_algorithm
from diffrl.configs.schema import load_experiment
from diffrl.engines.rollout import RolloutEngine
from diffrl.engines.rollout.config import SamplingConfig
from diffrl.engines.train.config import TrainConfig
from diffrl.engines.train.trainer import PolicyTrainer
from diffrl.models.base import load_adapter

SAMPLING = SamplingConfig(num_inference_steps=3, height=32, width=32, noise_level=0.7, batch_size=4)
PROMPTS = ["a red cube", "a red cube", "two cats", "two cats"]


def _generate(engine: RolloutEngine, sampling: SamplingConfig = SAMPLING):
    return engine.generate(PROMPTS, ["g0", "g0", "g1", "g1"], [0, 1, 0, 1], [11, 12, 13, 14], sampling)


def test_compiled_blocks_sample_the_same_trajectories(tiny_model):
    adapter = load_adapter(tiny_model("sd3"), device="cpu", dtype=torch.float32)
    engine = RolloutEngine(adapter, progress=False)
    eager = _generate(engine)
    # aot_eager: dynamo + autograd tracing without a C++ toolchain; inductor is what model.compile uses
    assert adapter.compile_blocks(backend="aot_eager") == len(adapter.transformer.transformer_blocks)
    assert all(block._compiled_call_impl is not None for block in adapter.transformer.transformer_blocks)
    compiled = _generate(engine)
    torch.testing.assert_close(compiled.latents, eager.latents, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled.log_probs, eager.log_probs, atol=1e-5, rtol=1e-5)


def test_lora_trains_through_compiled_blocks(tiny_model):
    """LoRA added after compiling (recompiles once); the update moves the LoRA weights and replay matches."""
    adapter = load_adapter(tiny_model("sd3"), device="cpu", dtype=torch.float32)
    adapter.compile_blocks(backend="aot_eager")
    engine = RolloutEngine(adapter, progress=False)
    trainer = PolicyTrainer(
        adapter,
        get_algorithm("flow_grpo", kl_coef=0.0),
        TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2, mini_batch_prompts=2, micro_batch_size=4),
        SAMPLING,
        group_size=2,
        device=torch.device("cpu"),
    )
    traj = _generate(engine)
    metrics = trainer.update(traj, torch.tensor([1.0, -1.0, 0.5, -0.5]), engine)
    assert metrics["rollout_corr/logprob_abs_diff_max"] <= 1e-5  # compiled replay == compiled rollout
    moved = [p for n, p in adapter.transformer.named_parameters() if "lora_B" in n and p.abs().max() > 0]
    assert moved and metrics["actor/grad_norm"] > 0


def test_model_compile_is_a_config_switch():
    assert load_experiment("quickstart", []).model.compile is False
    assert load_experiment("quickstart", ["model.compile=true"]).model.compile is True
