"""train.lora_compute: the LoRA branch multiplies in fp32 (default) or in the base's bf16 with fp32 master weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffrl.algorithms.catalog import get_algorithm
from diffrl.configs.rollout import SamplingConfig
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout.engine import RolloutEngine
from diffrl.engines.train.setup import CastLinear, set_lora_compute_dtype
from diffrl.engines.train.trainer import PolicyTrainer
from diffrl.models.base import load_adapter

SAMPLING = SamplingConfig(num_inference_steps=3, height=32, width=32, noise_level=0.7, batch_size=4)


def _trainer(path: str, **cfg) -> tuple:
    adapter = load_adapter(path, dtype=torch.bfloat16)
    trainer = PolicyTrainer(
        adapter,
        get_algorithm("flow_grpo", kl_coef=0.0, clip_ratio=0.2),
        TrainConfig(
            **{
                "lora_rank": 4,
                "lora_alpha": 8,
                "lr": 1e-2,
                "mini_batch_prompts": 1,
                "micro_batch_size": 2,
                "seed": 1,
                **cfg,
            }
        ),
        SAMPLING,
        group_size=2,
    )
    return adapter, trainer


def _first_lora_layer(transformer):
    from peft.tuners.lora import LoraLayer

    return next(m for m in transformer.modules() if isinstance(m, LoraLayer))


def test_base_compute_is_the_bf16_closed_form_and_trains_the_fp32_weights(tiny_model):
    adapter, _ = _trainer(tiny_model("sd3"), lora_compute="base")
    layer = _first_lora_layer(adapter.transformer)
    a, b = layer.lora_A["default"], layer.lora_B["default"]
    assert isinstance(a, CastLinear) and a.weight.dtype == torch.float32 and b.weight.dtype == torch.float32
    with torch.no_grad():
        b.weight.normal_(0, 0.1)  # B starts at 0: give the branch something to add
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    out = layer(x)
    s = layer.scaling["default"]
    base = layer.get_base_layer()(x)
    expected = base + F.linear(F.linear(x, a.weight.bfloat16()), b.weight.bfloat16()) * s
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    out.float().square().sum().backward()
    assert a.weight.grad.dtype == torch.float32 and b.weight.grad.dtype == torch.float32
    assert a.weight.grad.abs().sum() > 0 and b.weight.grad.abs().sum() > 0

    # Back to fp32 compute: the input is cast to the fp32 weights, the result back to bf16.
    assert set_lora_compute_dtype(adapter.transformer, None) > 0
    assert type(a) is torch.nn.Linear and layer.cast_input_dtype_enabled
    fp32 = (base.float() + F.linear(F.linear(x.float(), a.weight), b.weight) * s).bfloat16()
    torch.testing.assert_close(layer(x), fp32, atol=0, rtol=0)


def test_parameter_names_and_dtypes_do_not_change(tiny_model):
    fp32_adapter, _ = _trainer(tiny_model("sd3"))
    base_adapter, _ = _trainer(tiny_model("sd3"), lora_compute="base")
    names = {n: p.dtype for n, p in fp32_adapter.transformer.named_parameters()}
    assert {n: p.dtype for n, p in base_adapter.transformer.named_parameters()} == names
    assert all(v == torch.float32 for n, v in names.items() if "lora_" in n)


def test_rollout_and_replay_share_numerics_and_the_update_follows_the_advantage(tiny_model):
    """bf16 on CPU (the tiny model): rollout and trainer use the same bf16 LoRA branch, so the replayed
    log-probs equal the rollout's and the update raises the preferred sample's log-probs."""
    adapter, trainer = _trainer(tiny_model("sd3"), lora_compute="base")
    engine = RolloutEngine(adapter, progress=False)
    traj = engine.generate(
        ["a red cube", "a red cube"], ["g0", "g0"], [0, 1], [11, 12], SAMPLING, policy_version=trainer.policy_version
    )
    metrics = trainer.update(traj, torch.tensor([1.0, -1.0]), engine)
    assert metrics["rollout_corr/logprob_abs_diff_max"] == 0.0
    assert metrics["actor/skipped_steps"] == 0 and metrics["actor/grad_norm"] > 0
    with torch.no_grad():
        after = torch.stack([engine.replay(traj, j, SAMPLING).log_prob for j in range(traj.window_size)], dim=1)
    assert (after[0] > traj.log_probs[0]).all() and (after[1] < traj.log_probs[1]).all(), (traj.log_probs, after)


def test_unknown_lora_compute_names_the_field():
    with pytest.raises(ValueError, match="lora_compute"):
        TrainConfig(lora_compute="fp8")
