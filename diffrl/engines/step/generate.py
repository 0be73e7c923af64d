"""Stages that make a step's samples: `generate` (a chunk's rollout), `score` (its rewards), `offline_pairs`
(offline DPO's rows), `dataset_samples` (SFT's rows), and the prefetch of the next step's rollout. Each is
`stage(engines, step[, chunk])`, runs where its role lives (engines.run) and returns a typed record
(diffrl/engines/step/records.py).

Data flow (diffrl/engines/step/memory.py): a chunk stays in this process's memory for the stages after it; its rows
and rewards are queued on the ordered background writer. What memory lacks (a resumed step, another
process's output) is read from the trajectory store.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import torch

from diffrl.engines.handle import Engines
from diffrl.engines.numbering import step_number
from diffrl.engines.reward.base import concat_outputs, select_outputs
from diffrl.engines.reward.image_stats import stat_sums
from diffrl.engines.step.memory import ChunkRewards
from diffrl.engines.step.plan import (
    chunk_plan,
    inject_fault,
    num_chunks,
    own_chunks,
    sample_seed,
    validation_due,
)
from diffrl.engines.step.records import Generated, Scored
from diffrl.engines.store.preference import vae_encode
from diffrl.engines.train.preference import sampling_with_old_adapter
from diffrl.engines.trajectories import Trajectories
from diffrl.models.base import SampleShape

PREFERENCE_REWARD = "preference"  # the reward component of offline pairs: 1 chosen, 0 rejected


def uses_old_policy_rollout(algorithm: Any) -> bool:
    """Whether the algorithm samples its rollouts with its old (EMA) adapter (DiffusionNFT, as its published code)."""
    return algorithm.needs.samples_with_old_adapter


def step_chunks(cfg: Any) -> int:
    """Chunks a step's rows come in: offline pairs are one chunk, online rollouts num_chunks(cfg)."""
    return 1 if cfg.data.sample_source == "offline" else num_chunks(cfg)


def store_call(engines: Engines, step: int, what: str, fn, *args, **kwargs):
    """A store operation after every write made before it (the writer owns the store while a step runs)."""
    if engines.store is None:
        raise ValueError(f"{what}: this run keeps no trajectory store (engines-only), and the data is not in memory")
    engines.memory.release_writes()
    return engines.memory.writer.call(step, what, functools.partial(fn, *args, **kwargs))


def store_submit(engines: Engines, step: int, what: str, fn, *args) -> None:
    """A durable write, in order behind the writes before it (held until the update: StepMemory.queue_write);
    nothing when the run keeps no store."""
    if engines.store is not None:
        engines.memory.queue_write(step, what, fn, *args)


def maybe_committed(engines: Engines, step: int) -> bool:
    """Whether `step` may have rows from an earlier process (a resumed step, or Ray's other actors)."""
    memory = engines.memory
    return engines.store is not None and (not memory.asynchronous or step <= memory.first_step)


# ---- generate -----------------------------------------------------------------------------------------
def generate(engines: Engines, step: int, chunk: int) -> Generated:
    """Roll out one chunk (or take the rollout that ran ahead of this stage) and queue its rows for the store;
    a chunk already committed is not generated again."""
    memory, started = engines.memory, time.perf_counter()
    if not memory.has_chunk(step, chunk) and maybe_committed(engines, step):
        rows = store_call(engines, step, f"chunk_rows({step}, {chunk})", engines.store.chunk_rows, step, chunk)
        if rows:
            return Generated(step, chunk, rows=rows, seconds=0.0, waited=0.0, reused=True)
    if not memory.has_chunk(step, chunk):
        memory.start_rollout(step, chunk, functools.partial(sample_chunk, engines, step, chunk))
    traj, seconds = memory.chunk(step, chunk)
    store_submit(engines, step, f"rows of step {step_number(step)} chunk {chunk}", _append, engines, traj, step, chunk)
    return Generated(step, chunk, rows=len(traj), seconds=seconds, waited=time.perf_counter() - started, reused=False)


def sample_chunk(engines: Engines, step: int, chunk: int) -> Trajectories:
    """The rollout of one chunk (on the rollout worker); streams each decoded sub-batch to the reward worker
    when the reward lives in this process, and samples DiffusionNFT's rollouts with its old adapter."""
    inject_fault("generate", step, chunk)
    cfg, memory = engines.config, engines.memory
    plan = chunk_plan(engines, step, chunk)
    records = plan["records"]
    prompts = [r.prompt for r in records]
    metadata = [{"ground_truth": r.ground_truth, **r.metadata} for r in records]
    memory.reset_stream(step, chunk)
    on_batch = None
    if engines.reward is not None and memory.asynchronous:

        def on_batch(rows: list[int], outputs: torch.Tensor | list[str]) -> None:
            # rows: the batch's rows of this chunk (not contiguous when rollout.sort_by_window reorders the batches)
            score = functools.partial(engines.reward, outputs, [prompts[r] for r in rows], [metadata[r] for r in rows])
            memory.stream_reward(step, chunk, rows, score)

    with _rollout_policy(engines):
        return engines.rollout.generate(
            prompts,
            [r.uid for r in records],
            plan["sample_index"],
            plan["seeds"],
            cfg.sampling,
            step=step,
            policy_version=engines.policy_version,
            metadata=metadata,
            on_batch=on_batch,
        )


def _rollout_policy(engines: Engines):
    """The policy a rollout samples with: the trained one, or DiffusionNFT's old adapter (the trainer's module, or in
    an asynchronous run the behaviour copy's own old adapter, of the copy's version)."""
    if not uses_old_policy_rollout(engines.config.algorithm):
        return contextlib.nullcontext()
    trainer, adapter = engines.trainer, engines.rollout.adapter
    if trainer is not None and engines.config.run.async_.enabled and adapter is trainer.rollout_copy:
        return sampling_with_old_adapter(adapter)
    if trainer is None or adapter is not trainer.adapter:
        raise ValueError(
            f"{engines.config.algorithm.name} samples with the trainer's old LoRA adapter, so the rollout must run on "
            "the trainer's model (its engine replica's own) or, in an asynchronous run, on its behaviour copy"
        )
    return trainer.old_policy()


def _append(engines: Engines, traj: Trajectories, step: int, chunk: int) -> None:
    inject_fault("write_rows", step, chunk)  # a crash before the rows land, after their stage completed
    engines.store.append(traj, run=engines.config.run.name, step=step, chunk=chunk)


def prefetch(engines: Engines, step: int) -> int:
    """Start the rollout of every chunk of `step` on the rollout worker (right after the previous step's weight
    sync: the same weights, prompts and seeds as on demand; in an asynchronous run when the previous step's update
    starts, on the behaviour copy); returns the chunks of this replica's share. Not done for offline
    pairs, after the run's last step, before a validation or a guard probe (they sample on the same model), or when
    stages may run in other processes (Ray: their inputs must come from the store)."""
    cfg, memory = engines.config, engines.memory
    if (
        not memory.asynchronous
        or engines.rollout is None
        or cfg.data.sample_source == "offline"
        or step >= cfg.run.steps
        or validation_due(cfg, step)
        or cfg.run.guard.probe_due(step)
    ):
        return 0
    chunks = own_chunks(cfg)  # this replica's share (every chunk with one process)
    for chunk in chunks:
        memory.start_rollout(step, chunk, functools.partial(sample_chunk, engines, step, chunk))
    return len(chunks)


# ---- score --------------------------------------------------------------------------------------------
def score(engines: Engines, step: int, chunk: int) -> Scored:
    """The rewards of one chunk (streamed while it was sampled, or scored now) and their queued write."""
    inject_fault("score", step, chunk)
    memory = engines.memory
    streamed = memory.take_streamed(step, chunk)
    held = memory.chunk(step, chunk)
    traj = (
        held[0]
        if held is not None
        else store_call(
            engines,
            step,
            f"read step {step_number(step)} chunk {chunk}",
            engines.store.read_chunk,
            step,
            chunk,
            with_latents=False,
        )
    )
    if streamed is not None:
        outputs, rows, seconds = streamed
        assert sorted(rows) == list(range(len(traj))), f"streamed rows {rows} of chunk {chunk} are not its rows"
        out = select_outputs(concat_outputs(outputs), torch.argsort(torch.tensor(rows)).tolist())  # in row order
    else:
        started = time.perf_counter()
        out = engines.reward(traj.outputs, traj.prompts, traj.metadata)
        seconds = time.perf_counter() - started
    if not bool(out.valid.any()):  # nothing to learn from: the stage fails, nothing is kept, a rerun scores again
        raise engines.reward.nothing_scored(out, f"step {step_number(step)} chunk {chunk}")
    components = {name: torch.tensor(out.info[name], dtype=torch.float32) for name in engines.reward.names}
    memory.put_rewards(step, chunk, ChunkRewards(out.scores, out.valid, components, out.info, seconds))
    store_submit(
        engines,
        step,
        f"rewards of step {step_number(step)} chunk {chunk}",
        _write_rewards,
        engines,
        step,
        traj,
        out.scores,
        components,
        out.valid,
    )
    image_stats = stat_sums(traj.outputs) if engines.config.run.guard.image_stats else {}
    return Scored(step, chunk, len(traj), seconds, int((~out.valid).sum()), image_stats)


def _write_rewards(engines: Engines, step: int, keys: Any, scores, components, valid) -> None:
    engines.store.write_rewards(step, keys, scores, components, valid)


# ---- offline samples (a dataset's: offline DPO's pairs, SFT's images) ------------------------------------------
def _offline_chunk(engines: Engines, step: int, stage: str, make, what: str) -> tuple[Trajectories, bool]:
    """Stage `stage`'s offline rows as chunk 0: `make(engines, step)`, queued for the store; a committed step is read
    back (its rows without latents) instead. Returns (rows, reused)."""
    if maybe_committed(engines, step) and store_call(engines, step, "has_chunk", engines.store.has_chunk, step, 0):
        traj = store_call(
            engines, step, f"read {what}", engines.store.read_chunk, step, 0, with_latents=False, with_images=False
        )
        return traj, True
    inject_fault(stage, step)
    traj = make(engines, step)
    engines.memory.put_chunk(step, 0, traj, 0.0)
    store_submit(engines, step, f"{what} of step {step_number(step)}", _append, engines, traj, step, 0)
    return traj, False


def offline_pairs(engines: Engines, step: int, chunk: int = 0) -> Generated:
    """Offline DPO: the step's preference pairs (from the VAE-latent cache) as chunk 0, with reward 1 for the
    chosen and 0 for the rejected image; a committed step is reused."""
    started = time.perf_counter()
    traj, reused = _offline_chunk(engines, step, "offline_pairs", _pair_trajectories, "pairs")
    rewards = (traj.sample_index == 0).float()
    valid = torch.ones(len(traj), dtype=torch.bool)
    components = {PREFERENCE_REWARD: rewards}
    engines.memory.put_rewards(step, 0, ChunkRewards(rewards, valid, components, {}, 0.0))
    # Rewards are written after the rows; writing them again is a no-op, so a crash in between heals here.
    store_submit(
        engines,
        step,
        f"pair rewards of step {step_number(step)}",
        _write_rewards,
        engines,
        step,
        traj,
        rewards,
        components,
        valid,
    )
    return Generated(step, 0, rows=len(traj), seconds=time.perf_counter() - started, waited=0.0, reused=reused)


def dataset_samples(engines: Engines, step: int, chunk: int = 0) -> Generated:
    """SFT: the step's (prompt, image) rows of the dataset, their images VAE-encoded, as chunk 0; no reward. A
    committed step is reused."""
    started = time.perf_counter()
    traj, reused = _offline_chunk(engines, step, "dataset_samples", _dataset_trajectories, "samples")
    return Generated(step, 0, rows=len(traj), seconds=time.perf_counter() - started, waited=0.0, reused=reused)


def _pair_trajectories(engines: Engines, step: int) -> Trajectories:
    """(2P) samples of the step's P pairs, chosen then rejected (group = the pair)."""
    records = engines.prompts.sample(step)
    latents_P2S, images_P2HWC = engines.preferences.read([r.metadata["pair"] for r in records])
    return _final_samples(
        engines,
        step,
        [r for r in records for _ in range(2)],
        torch.tensor([0, 1] * len(records)),
        latents_P2S.flatten(0, 1),
        images_P2HWC.flatten(0, 1),
        [{"pair": r.metadata["pair"], "label": label} for r in records for label in ("chosen", "rejected")],
    )


def _dataset_trajectories(engines: Engines, step: int) -> Trajectories:
    """The step's b dataset rows, one sample each (group = the row), x0 the VAE latents of the resized image."""
    sampling = engines.config.sampling
    records = engines.prompts.sample(step)
    images_BHWC = engines.dataset.images([r.metadata["row"] for r in records], sampling.height, sampling.width)
    shape = SampleShape(sampling.height, sampling.width, sampling.num_frames, sampling.duration)
    x0 = vae_encode(engines.adapter, images_BHWC, shape)
    index = torch.zeros(len(records), dtype=torch.long)
    return _final_samples(engines, step, records, index, x0, images_BHWC, [{"row": r.metadata["row"]} for r in records])


def _final_samples(
    engines: Engines, step: int, records: list, sample_index: torch.Tensor, x0: torch.Tensor, images, metadata
) -> Trajectories:
    """Offline samples (one PromptRecord per row) as a one-step window ending at x0. Only the clean latent
    latents[:, -1] is trained on by the final-sample trainer; an offline sample has no denoising trajectory, so
    latents[:, 0] repeats x0 and the log-probs are 0."""
    cfg = engines.config
    sampling = cfg.sampling
    n = sampling.num_inference_steps
    b = x0.shape[0]
    shape = SampleShape(sampling.height, sampling.width, sampling.num_frames, sampling.duration)
    last_sigma = float(engines.adapter.sigmas(n, shape)[n - 1])
    prompts = [r.prompt for r in records]
    encoder = engines.rollout if engines.rollout is not None else engines.trainer.replayer
    return Trajectories(
        prompts=prompts,
        group_ids=[r.uid for r in records],
        sample_index=sample_index,
        seeds=torch.tensor([sample_seed(cfg.run.seed, step, k) for k in range(b)]),
        latents=torch.stack([x0, x0], 1).float().contiguous(),
        log_probs=torch.zeros(b, 1),
        sigmas=torch.full((b, 1), last_sigma),
        sigmas_prev=torch.zeros(b, 1),
        window_starts=torch.full((b,), n - 1),
        trained=torch.ones(b, 1, dtype=torch.bool),
        images=images,
        embed_keys=[encoder.embed_key(p, sampling) for p in prompts],
        metadata=metadata,
        policy_version=engines.trainer.policy_version,
    )


# ---- what later stages and the flow read ----------------------------------------------------------------
def step_trajectories(
    engines: Engines, step: int, *, with_latents: bool = True, with_images: bool = False
) -> Trajectories:
    """The step's samples in (chunk, row) order: from memory, else from the store."""
    parts = engines.memory.chunks(step, step_chunks(engines.config))
    if parts is not None:
        return type(parts[0]).cat(parts)  # Trajectories or TokenTrajectories
    return store_call(
        engines,
        step,
        f"read step {step_number(step)}",
        engines.store.read_step,
        step,
        with_latents=with_latents,
        with_images=with_images,
    )


def step_rewards(engines: Engines, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(rewards (B,), components {name: (B,)}, valid (B,)) of the step, aligned with step_trajectories: from memory
    (the whole step's as the replicas exchanged them, or every chunk's scored here), else from the store."""
    memory = engines.memory
    held = memory.step_rewards(step)
    if held is None:
        held = memory.rewards_of(step, list(range(step_chunks(engines.config))))
    if held is None:
        return store_call(engines, step, f"read rewards of step {step_number(step)}", engines.store.read_rewards, step)
    return held


def step_reward_info(engines: Engines, step: int, kept: torch.Tensor) -> dict[str, float]:
    """reward/<key>: the mean over the `kept` samples of each per-sample number the reward reported besides its
    components' scores (e.g. reward/geneval_lite/accuracy), when the step was scored in this process."""
    parts = engines.memory.rewards(step, step_chunks(engines.config))
    if parts is None:
        return {}
    out = {}
    for key in parts[0].info:
        values = [v for p in parts for v in p.info.get(key, [])]
        if (
            key in parts[0].components
            or key.startswith("excluded")
            or len(values) != len(kept)
            or not all(isinstance(v, (bool, int, float)) for v in values)
        ):
            continue
        numbers = torch.tensor([float(v) for v in values])[kept]
        numbers = numbers[~torch.isnan(numbers)]
        if numbers.numel():
            out[f"reward/{key}"] = float(numbers.mean())
    return out


def rollout_examples(engines: Engines, step: int, count: int) -> tuple[Any, list[str], torch.Tensor]:
    """The first `count` samples of a step's first chunk as (outputs: images, or a token rollout's response texts;
    prompts; rewards) (what the flow logs to MLflow): from memory while the step is held there, else from the store.
    A reward is NaN where excluded, and for a dataset's samples (SFT)."""
    held = engines.memory.chunk(step, 0) if engines.memory is not None else None
    if held is not None:
        traj = held[0]
    else:
        traj = store_call(engines, step, "read images", engines.store.read_chunk, step, 0, with_latents=False)
    count = min(count, len(traj))
    if engines.config.algorithm.needs.supervised:  # a dataset's images: no reward
        return traj.outputs[:count], list(traj.prompts[:count]), torch.full((count,), float("nan"))
    rewards, _, valid = step_rewards(engines, step)  # chunk 0's rows come first
    rewards = torch.where(valid[:count], rewards[:count], torch.full_like(rewards[:count], float("nan")))
    return traj.outputs[:count], list(traj.prompts[:count]), rewards
