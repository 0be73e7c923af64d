"""rollout.weights: merged LoRA and FP8 linears for the rollout only, on the tiny SD3 with a LoRA trainer.

Off ("lora") is the plain LoRA sampler; "merged" samples what the LoRA path samples (fp32); "fp8" is checked against its
closed forms and runs end to end; "steps: deterministic" keeps the stored window (latents, log-probs) bit for bit;
the trainer recomputes old log-probs exactly when the rollout's are not its numerics.
"""

from __future__ import annotations

import logging
import math
import threading

import pytest
import torch
from torch import nn

from diffrl.algorithms.catalog import get_algorithm
from diffrl.algorithms.windows import WindowPolicy
from diffrl.configs.rollout import RolloutWeights, SamplingConfig
from diffrl.configs.schema import load_experiment
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout import fast_weights
from diffrl.engines.rollout.engine import RolloutEngine
from diffrl.engines.rollout.fast_weights import (
    FP8_MAX,
    FastWeights,
    dequantize_rows,
    fp8_linear,
    quantize_rows,
    row_scales,
    scaled_mm_supported,
)
from diffrl.engines.train.trainer import PolicyTrainer
from diffrl.models.base import load_adapter

PROMPTS, GROUPS, SEEDS = ["a red cube", "two cats"], ["g0", "g1"], [11, 12]
# windows start at step 0 for every sample: no head steps, so "deterministic" leaves the whole window untouched
WINDOW = WindowPolicy("random_start", size=2, start_range=(0, 1))


def _sampling(**overrides) -> SamplingConfig:
    base = dict(num_inference_steps=5, height=32, width=32, noise_level=0.7, batch_size=2, window=WINDOW)
    return SamplingConfig(**{**base, **overrides})


def _setup(path: str, sampling: SamplingConfig, *, perturb: bool = True, **train):
    """(engine, trainer) on one fp32 tiny SD3 with LoRA; `perturb` gives lora_B non-zero (seeded) values."""
    adapter = load_adapter(path, device="cpu", dtype=torch.float32)
    defaults = dict(lora_rank=4, lora_alpha=8, lr=1e-2, mini_batch_prompts=1, micro_batch_size=2, seed=1)
    trainer = PolicyTrainer(
        adapter,
        get_algorithm("flow_grpo", kl_coef=0.0, clip_ratio=0.2),
        TrainConfig(**{**defaults, **train}),
        sampling,
        group_size=2,
    )
    if perturb:
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, param in adapter.transformer.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return RolloutEngine(adapter, progress=False), trainer


@pytest.fixture(scope="module")
def lora_engine(tiny_model):
    return _setup(tiny_model("sd3"), _sampling())


def _generate(engine: RolloutEngine, cfg: SamplingConfig):
    return engine.generate(PROMPTS, GROUPS, [0, 0], SEEDS, cfg)


def _classes(module: nn.Module) -> list[type]:
    return [type(m) for m in module.modules()]


def _replayed(engine: RolloutEngine, traj, cfg: SamplingConfig) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([engine.replay(traj, j, cfg).log_prob for j in range(traj.window_size)], dim=1)


# ---- config -------------------------------------------------------------------------------------------------
def test_config_checks_name_the_field_and_the_yaml_section_loads():
    with pytest.raises(ValueError, match=r"weights.kind must be one of \['lora', 'merged', 'fp8'\]"):
        RolloutWeights("int8")
    with pytest.raises(ValueError, match=r"weights.steps must be one of \['all', 'deterministic'\]"):
        RolloutWeights("fp8", "stochastic")
    assert load_experiment(None, []).sampling.weights == RolloutWeights("lora", "all")
    cfg = load_experiment(None, ["rollout.weights={kind: fp8, steps: deterministic}"])
    assert cfg.sampling.weights == RolloutWeights("fp8", "deterministic") and cfg.sampling.weights.trainer_numerics
    assert not RolloutWeights("merged").trainer_numerics and RolloutWeights("lora").trainer_numerics


# ---- merged -------------------------------------------------------------------------------------------------
def test_merged_samples_what_lora_samples_and_leaves_the_module_as_it_was(lora_engine):
    engine, _ = lora_engine
    transformer = engine.adapter.transformer
    classes, state = _classes(transformer), {k: v.clone() for k, v in transformer.state_dict().items()}
    lora = _generate(engine, _sampling())
    replay_before = _replayed(engine, lora, _sampling())
    fast = FastWeights(engine.adapter.denoisers(), RolloutWeights("merged"))
    from peft.tuners.lora import LoraLayer

    assert len(fast._swapped) == sum(isinstance(m, LoraLayer) for m in transformer.modules()) == 15  # every one
    fast.free()
    merged = _generate(engine, _sampling(weights=RolloutWeights("merged")))
    for name in ("latents", "log_probs"):
        a, b = getattr(merged, name), getattr(lora, name)
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), name
    assert (merged.images.int() - lora.images.int()).abs().max() <= 1
    assert _classes(transformer) == classes
    after = transformer.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    assert not any(hasattr(m, "_rollout_weight_NK") for m in transformer.modules())
    assert torch.equal(_replayed(engine, lora, _sampling()), replay_before)  # the trainer's replay is unchanged


def test_an_exception_inside_a_forward_restores_the_classes(lora_engine):
    engine, _ = lora_engine
    classes = _classes(engine.adapter.transformer)
    fast = FastWeights(engine.adapter.denoisers(), RolloutWeights("fp8"))
    with pytest.raises(RuntimeError, match="boom"), fast.for_forward(stochastic=False):
        assert _classes(engine.adapter.transformer) != classes
        raise RuntimeError("boom")
    assert _classes(engine.adapter.transformer) == classes
    fast.free()


def test_the_emulated_path_warns_once(lora_engine, caplog, monkeypatch):
    engine, _ = lora_engine
    monkeypatch.setattr(fast_weights, "_warned_emulated", False)
    with caplog.at_level(logging.WARNING, logger=fast_weights.__name__):
        for _ in range(2):
            FastWeights(engine.adapter.denoisers(), RolloutWeights("fp8")).free()
    assert [r.message for r in caplog.records if "emulating" in r.message] == [caplog.records[0].message]


def test_a_forward_beside_a_fast_one_waits_and_runs_the_original_classes(lora_engine):
    # validation's generate (kind lora) beside the run-ahead rollout's (fp8) on the same module, in two threads
    engine, _ = lora_engine
    roots = engine.adapter.denoisers()
    fast, plain = FastWeights(roots, RolloutWeights("fp8")), FastWeights(roots, RolloutWeights("lora"))
    module = fast._swapped[0][0]
    original, seen = type(module), []

    def other_forward() -> None:
        with plain.for_forward(stochastic=False):
            seen.append(type(module))

    with fast.for_forward(stochastic=False):
        thread = threading.Thread(target=other_forward)
        thread.start()
        thread.join(timeout=0.2)
        assert thread.is_alive() and not seen  # waiting for the fast forward to end
    thread.join()
    fast.free()
    assert seen == [original]


# ---- fp8 math -----------------------------------------------------------------------------------------------
def test_row_scale_is_amax_over_448_and_a_zero_row_stays_finite():
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    x[2] = 0
    scale = row_scales(x)
    expected = x.abs().amax(dim=1, keepdim=True) / FP8_MAX
    assert torch.equal(scale[[0, 1, 3, 4, 5]], expected[[0, 1, 3, 4, 5]]) and scale[2].item() == 1.0
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and torch.isfinite(dequantize_rows(q, s)).all()
    assert torch.equal(dequantize_rows(q, s)[2], torch.zeros(32))
    out = fp8_linear(x, *quantize_rows(torch.randn(16, 32)), torch.ones(16), scaled_mm=False)
    assert torch.isfinite(out).all() and torch.equal(out[2], torch.ones(16))  # a zero input row: the bias


def test_quantize_dequantize_error_is_at_most_half_an_e4m3_ulp():
    # e4m3 keeps 3 mantissa bits: round-to-nearest is within 2**-4 relative for values in its normal range, i.e.
    # |x| / scale >= 2**-6 (here |x| within 2**5 of the row's amax)
    gen = torch.Generator().manual_seed(1)
    magnitude = 2.0 ** (torch.rand(8, 256, generator=gen) * -5) * torch.logspace(-3, 3, 8)[:, None]
    x = magnitude * torch.where(torch.rand(8, 256, generator=gen) < 0.5, -1.0, 1.0)
    error = (dequantize_rows(*quantize_rows(x)) - x).abs() / x.abs()
    assert error.max() <= 2**-4, error.max()


def test_fp8_linear_against_the_fp32_linear():
    gen = torch.Generator().manual_seed(2)
    x, w, bias = torch.randn(4, 16, 128, generator=gen), torch.randn(48, 128, generator=gen), torch.randn(48)
    out = fp8_linear(x, *quantize_rows(w), bias, scaled_mm=False)
    reference = x @ w.t() + bias
    assert out.shape == (4, 16, 48) and out.dtype == torch.float32
    # each product's factors are within (1 + 2**-4) of their values (normal range; Gaussian rows reach 2**-6 amax
    # rarely): |error| <= ((1 + 2**-4)**2 - 1) * (|x| @ |w|.T), elementwise
    bound = ((1 + 2**-4) ** 2 - 1) * (x.abs() @ w.abs().t())
    assert ((out - reference).abs() <= bound + 1e-6).all()
    relative = (out - reference).norm() / reference.norm()
    assert relative < 0.05, relative  # typical: ~2**-5 rounding per factor, averaging over K = 128 products


@pytest.mark.skipif(
    not (torch.cuda.is_available() and scaled_mm_supported(torch.device("cuda"))),
    reason="torch._scaled_mm FP8 needs a CUDA GPU with compute capability >= 8.9 (Ada/Hopper)",
)
def test_scaled_mm_equals_the_emulated_path_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(384, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    w_fp8, w_scale = quantize_rows(w)
    fast = fp8_linear(x, w_fp8, w_scale, None, scaled_mm=True).float()
    emulated = fp8_linear(x, w_fp8, w_scale, None, scaled_mm=False).float()
    # the same quantized operands; only the fp32 summation order and the bf16 rounding of the output differ
    assert ((fast - emulated).abs() <= 2**-7 * emulated.abs() + 1e-2).all()


# ---- fp8 rollouts -------------------------------------------------------------------------------------------
def test_fp8_rollout_runs_and_deterministic_steps_keep_the_window(lora_engine):
    engine, _ = lora_engine
    classes = _classes(engine.adapter.transformer)
    lora = _generate(engine, _sampling())
    fp8 = _generate(engine, _sampling(weights=RolloutWeights("fp8")))
    assert torch.isfinite(fp8.latents).all() and torch.isfinite(fp8.log_probs).all()
    assert fp8.images.float().std() > 0 and not torch.equal(fp8.images, lora.images)
    # steps: all: the window ran fp8 too. A rollout's log-prob of its own draw depends only on the noise and the
    # std, so the stored values agree; the drawn latents and the trainer's replay of them do not
    assert not torch.equal(fp8.latents[:, 1:], lora.latents[:, 1:])
    assert (_replayed(engine, fp8, _sampling()) - fp8.log_probs).abs().max() > 1e-4
    assert _classes(engine.adapter.transformer) == classes
    deterministic = _generate(engine, _sampling(weights=RolloutWeights("fp8", "deterministic")))
    assert torch.equal(deterministic.window_starts, torch.zeros(2, dtype=torch.int64))
    assert torch.equal(deterministic.log_probs, lora.log_probs) and torch.equal(deterministic.latents, lora.latents)
    assert not torch.equal(deterministic.images, lora.images)  # steps 2..4 ran fp8
    assert _classes(engine.adapter.transformer) == classes


def test_fp8_rollout_with_compiled_blocks(tiny_model):
    # a fresh model: compilation cannot be undone. dynamo recompiles each block once per class set (mode)
    engine, _ = _setup(tiny_model("sd3"), _sampling())
    eager = _generate(engine, _sampling(weights=RolloutWeights("fp8", "deterministic")))
    engine.adapter.compile_blocks(backend="eager")
    for weights in (RolloutWeights("fp8", "deterministic"), RolloutWeights("merged"), RolloutWeights("lora")):
        traj = _generate(engine, _sampling(weights=weights))
        assert torch.isfinite(traj.latents).all(), weights
        if weights == RolloutWeights("fp8", "deterministic"):
            assert torch.equal(traj.images, eager.images)


# ---- the trainer's old log-probs ----------------------------------------------------------------------------
@pytest.mark.parametrize("steps", ["all", "deterministic"])
def test_auto_recomputes_old_log_probs_only_when_the_rollout_ran_fp8_in_the_window(tiny_model, steps):
    sampling = _sampling(weights=RolloutWeights("fp8", steps))
    engine, trainer = _setup(tiny_model("sd3"), sampling, perturb=False, old_log_probs="auto")
    traj = engine.generate(PROMPTS, GROUPS, [0, 0], SEEDS, sampling, policy_version=trainer.policy_version)
    metrics = trainer.update(traj, torch.tensor([1.0, -1.0]))
    gap = metrics["rollout_corr/logprob_abs_diff_mean"]
    if steps == "all":
        # recomputed: the old log-probs are the replay's (ratio 1 in the one mini-batch), the fp8 gap is measured
        assert gap > 1e-4 and math.isclose(metrics["actor/ratio_mean"], 1.0, abs_tol=1e-5)
    else:
        # reused: the stored log-probs are the replay's own numerics
        assert gap <= 1e-6 and math.isclose(metrics["actor/ratio_mean"], 1.0, abs_tol=1e-5)
