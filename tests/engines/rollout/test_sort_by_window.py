"""rollout.sort_by_window on the tiny SD3: forward batches of the rows sorted by window start change no
sample (each has its own generator), come back in the caller's row order, end each batch's loop (and start its ODE
tail) at the batch's own latest window end, and stream rewards that equal scoring the chunk afterwards, row by row."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffrl.algorithms.windows import WindowPolicy, sample_windows
from diffrl.configs.loader import ConfigError
from diffrl.configs.rollout import OdeShortcut, SamplingConfig
from diffrl.configs.schema import load_experiment
from diffrl.engines import cluster
from diffrl.engines.rollout import RolloutEngine
from diffrl.engines.rollout.engine import forward_order
from diffrl.engines.step.generate import generate, score
from diffrl.flows.build import build_engines
from diffrl.models.base import load_adapter

STEPS, ROWS, BATCH, SIZE, TAIL = 10, 64, 16, 2, 2
QWEN_WINDOW = WindowPolicy("random_start", size=SIZE, start_range=(0, 5))  # the Qwen-Image recipe's window
PROMPTS = ["a red cube", "a cat", "a dog on grass", "a tree"]
PER_ROW = ("latents", "log_probs", "sigmas", "sigmas_prev", "window_starts", "trained", "images")


@pytest.fixture(scope="module")
def engine(tiny_model):
    return RolloutEngine(load_adapter(tiny_model("sd3"), device="cpu", dtype=torch.float32), progress=False)


def _config(**overrides) -> SamplingConfig:
    base = dict(
        num_inference_steps=STEPS,
        height=16,  # one latent token: 64 rows x 10 steps in seconds on a CPU
        width=16,
        guidance_scale=4.5,
        noise_level=0.7,
        batch_size=BATCH,
        window=QWEN_WINDOW,
    )
    return SamplingConfig(**{**base, **overrides})


def _generate(engine: RolloutEngine, cfg: SamplingConfig):
    """(trajectories of ROWS rows, evaluations per image, [rows of each forward batch])."""
    batches, before = [], engine.evaluations
    traj = engine.generate(
        [PROMPTS[i % 4] for i in range(ROWS)],
        [f"g{i % 4}" for i in range(ROWS)],
        [i // 4 for i in range(ROWS)],
        list(range(100, 100 + ROWS)),
        cfg,
        on_batch=lambda rows, images: batches.append((list(rows), images)),
    )
    for rows, images in batches:  # each streamed batch is its rows' images
        assert torch.equal(images, traj.images[rows])
    assert sorted(r for rows, _ in batches for r in rows) == list(range(ROWS))
    return traj, (engine.evaluations - before) / ROWS, [rows for rows, _ in batches]


def _closed_form_evaluations(starts: torch.Tensor, sort: bool) -> float:
    """Evaluations per image with the ODE tail on: a batch loops to its latest window end e, then the tail's K
    evaluations when the N - e steps left are more than K (else it loops to N)."""
    order = torch.sort(starts, stable=True).indices if sort else torch.arange(len(starts))
    total = 0
    for i in range(0, len(starts), BATCH):
        end = int(starts[order[i : i + BATCH]].max()) + SIZE
        total += len(order[i : i + BATCH]) * (end + TAIL if STEPS - end > TAIL else STEPS)
    return total / len(starts)


def test_sorting_changes_no_sample_and_keeps_the_callers_row_order(engine):
    cfg = _config()
    plain, plain_evals, plain_batches = _generate(engine, cfg)
    ordered, ordered_evals, ordered_batches = _generate(engine, dataclasses.replace(cfg, sort_by_window=True))
    assert plain_batches == [list(range(i, i + BATCH)) for i in range(0, ROWS, BATCH)]
    starts = plain.window_starts
    assert ordered_batches != plain_batches  # the batches are really formed differently
    for rows in ordered_batches:  # ... each a run of the stable sort on window start
        assert rows == sorted(rows, key=lambda r: (int(starts[r]), r))
    assert torch.equal(ordered.window_starts, starts) and ordered.prompts == plain.prompts
    for name in PER_ROW:
        a, b = getattr(plain, name), getattr(ordered, name)
        if a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
        else:
            assert torch.equal(b, a), name
    assert (ordered.images.int() - plain.images.int()).abs().max() <= 1  # uint8 pixels: rounding at most one level
    assert plain_evals == ordered_evals == STEPS  # without the ODE tail every batch runs all steps


def test_sorted_batches_with_the_ode_tail_make_the_closed_form_evaluations(engine):
    cfg = _config(ode_tail=OdeShortcut("ab2", TAIL))
    plain, plain_evals, _ = _generate(engine, cfg)
    ordered, ordered_evals, _ = _generate(engine, dataclasses.replace(cfg, sort_by_window=True))
    starts = sample_windows(QWEN_WINDOW, STEPS, torch.arange(100, 100 + ROWS), 0).starts
    assert torch.equal(plain.window_starts, starts)
    assert plain_evals == _closed_form_evaluations(starts, sort=False) == 8.0  # every batch has a start of 4
    assert ordered_evals == _closed_form_evaluations(starts, sort=True) == 6.5  # its batches end at 1, 2, 3, 4 + 2
    # the tail changes only the final sample: the stored windows are the same (rounding aside)
    for name in ("latents", "log_probs", "sigmas", "sigmas_prev"):
        torch.testing.assert_close(getattr(ordered, name), getattr(plain, name), rtol=1e-5, atol=1e-5, msg=name)


def test_equal_windows_are_bit_identical(engine):
    cfg = _config(window=WindowPolicy("all_but_last"), num_inference_steps=3, ode_tail=OdeShortcut("ab2", TAIL))
    plain, plain_evals, plain_batches = _generate(engine, cfg)
    ordered, ordered_evals, ordered_batches = _generate(engine, dataclasses.replace(cfg, sort_by_window=True))
    assert ordered_batches == plain_batches and ordered_evals == plain_evals
    for name in PER_ROW:
        assert torch.equal(getattr(ordered, name), getattr(plain, name)), name


def test_forward_order_is_a_stable_sort_on_window_start():
    starts = torch.tensor([3, 0, 3, 1, 0, 2])
    assert forward_order(starts, False) == [0, 1, 2, 3, 4, 5]
    assert forward_order(starts, True) == [1, 4, 3, 5, 0, 2]


def test_config_field_loads_and_is_checked():
    assert load_experiment(None, []).sampling.sort_by_window is False
    assert load_experiment(None, ["rollout.sort_by_window=true"]).sampling.sort_by_window is True
    with pytest.raises(ConfigError, match="sort_by_window"):
        load_experiment(None, ["rollout.sort_by_window=3"])
    with pytest.raises(TypeError, match="sort_by_window must be a bool"):
        _config(sort_by_window="yes")


def test_streamed_rewards_of_a_sorted_rollout_equal_scoring_the_chunk_row_by_row(tiny_model, tmp_path):
    """The step core's generate and score stages with 2-row forward batches of rows sorted by window start: the
    rewards streamed batch by batch, put back in row order, are those of scoring the chunk's rows afterwards."""
    cfg = load_experiment(
        None,
        [
            f"model.path={tiny_model('sd3')}",
            f"run.root={tmp_path}/runs",
            "run.name=sorted-stream",
            "reward.components=[{name: jpeg_compressibility}]",
            "data.train=generator:ocr",
            "data.val=null",
            "data.num_generated=16",
            "algorithm={name: flow_grpo, kl_coef: 0.0, noise_level: 0.7,"
            " window: {kind: random_start, size: 1, start_range: [0, 3]}}",
            "rollout.max_sequence_length=null",
            "rollout.guidance_scale=4.5",
            "rollout.num_inference_steps=3",
            "rollout.height=32",
            "rollout.width=32",
            "rollout.group_size=4",
            "rollout.prompts_per_step=2",
            "rollout.chunk_size=4",
            "rollout.batch_size=2",
            "rollout.sort_by_window=true",
            "train.mini_batch_prompts=2",
        ],
    )
    engines = build_engines(cfg, durable=False)
    try:
        assert engines.memory.asynchronous and engines.reward is not None  # the rewards are streamed
        permuted = 0
        for chunk in range(2):
            generate(engines, 0, chunk)
            traj, _ = engines.memory.chunk(0, chunk)
            order = forward_order(traj.window_starts, True)
            permuted += order != sorted(order)
            # what score() will read: the batches' rows beside their reward futures, in forward order
            assert [r for rows, _ in engines.memory._streamed[(0, chunk)] for r in rows] == order
            score(engines, 0, chunk)
            streamed = engines.memory.rewards(0, chunk + 1)[chunk]
            direct = engines.reward(traj.outputs, traj.prompts, traj.metadata)
            assert torch.equal(streamed.scores, direct.scores) and torch.equal(streamed.valid, direct.valid)
            assert streamed.info == direct.info
        assert permuted  # at least one chunk's batches were not its consecutive rows
    finally:
        engines.memory.drain()
        cluster.drop("sorted-stream")
