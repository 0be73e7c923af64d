"""model.compile: the denoiser's transformer blocks torch.compiled in place (ModelAdapter.compile_blocks).

The speed is measured on the GPU (benchmarks/sampler_vs_diffusers.py --compile); here: which modules are
compiled, that sampling gives the same trajectories, and that a LoRA trainer still trains through them.
"""

from __future__ import annotations

import pytest
import torch

from diffrl.algorithms.catalog import get_algorithm
from diffrl.configs.rollout import SamplingConfig
from diffrl.configs.schema import load_experiment
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout import RolloutEngine
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


def test_compiled_qwen_image_pads_text_to_static_buckets(tiny_model):
    """Prompts of different lengths would give the compiled blocks a new text length each (a second full compile in a
    real run's second step, then a dynamic length). Once compiled, Qwen-Image pads the text to `text_bucket`
    lengths: two lengths in one bucket compile one graph, and the velocity equals the eager, unpadded one."""
    import torch._dynamo

    from diffrl.models.base import SampleShape, text_bucket

    adapter = load_adapter(tiny_model("qwen_image"), device="cpu", dtype=torch.float32)
    shape = SampleShape(32, 32)
    short, long = (adapter.encode_prompt([p]) for p in ("a cube", "two red cats and a blue dog under a tree"))
    negative = adapter.encode_prompt([" "])
    lengths = {short["prompt_embeds"].shape[1], long["prompt_embeds"].shape[1]}
    assert len(lengths) == 2 and {text_bucket(n) for n in lengths} == {32}
    latents = adapter.prepare_latents(shape, [torch.Generator().manual_seed(0)])
    sigma = adapter.sigmas(3, shape)[1:2]

    def velocities():
        return [
            adapter.velocity(latents, sigma, enc, negative, guidance_scale=4.0, shape=shape) for enc in (short, long)
        ]

    with torch.no_grad():
        eager = velocities()
        adapter.compile_blocks(backend="eager")
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = velocities()
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one static shape for both prompts


def test_text_bucket_and_pad_tokens():
    from diffrl.models.base import pad_tokens, text_bucket

    assert [text_bucket(n) for n in (1, 18, 32, 33, 128, 129, 300, 512)] == [32, 32, 32, 64, 128, 256, 384, 512]
    enc = {"prompt_embeds": torch.ones(2, 5, 3), "prompt_embeds_mask": torch.ones(2, 5, dtype=torch.long)}
    out = pad_tokens(enc, ("prompt_embeds", "prompt_embeds_mask"), 8)
    assert out["prompt_embeds"].shape == (2, 8, 3) and out["prompt_embeds"][:, 5:].abs().sum() == 0
    assert out["prompt_embeds_mask"].tolist() == [[1] * 5 + [0] * 3] * 2
    with pytest.raises(ValueError, match="more than the 4"):
        pad_tokens(enc, ("prompt_embeds",), 4)
