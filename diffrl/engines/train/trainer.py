"""The trainer: updates the policy with any diffusion algorithm by asking it (`algorithm.needs`, docs/architecture.md).

`algorithm.needs` says what to prepare -- replays of the stored denoising steps or the final samples re-noised by the
forward process, old-policy log-probs or transition means, a reference forward, an EMA "old" adapter, pairs or every
sample -- and `algorithm.loss(batch)` computes one micro-batch's loss from a typed batch (diffrl/algorithms/batches.py).
No algorithm is named here.

Legend: B samples of one RL step (the same Trajectories on every rank), M = mini_batch_prompts x
group_size samples per optimizer step (over all ranks; mini_batch_prompts pairs for pair algorithms), b samples per
micro-batch (one rank), W window steps, T trained steps per sample.

Loss scaling: each (micro-batch, step) loss is a mean over its b samples; it is multiplied by
b / (M_local x T) before its own backward (T = 1 for final samples, b and M counting pairs for pair algorithms), so one
optimizer step sees the mean over all of its samples and trained steps -- "loss / (micro-batches x steps)" when
micro-batches are equal -- and FSDP's gradient averaging over ranks makes 1 and N processes compute the same update.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from diffrl.algorithms.base import Algorithm
from diffrl.algorithms.batches import SampleBatch, StepBatch
from diffrl.configs.rollout import SamplingConfig
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout.engine import RolloutEngine, to_device
from diffrl.engines.train import checkpoint, sync
from diffrl.engines.train.base import TrainerBase
from diffrl.engines.train.policy_loss import (
    OldPolicy,
    active_steps,
    correction_stats,
    correction_weights,
    frozen_denoiser,
    lora_disabled,
    rank_rows,
    recompute_old_policy,
)
from diffrl.engines.train.preference import (
    OLD_ADAPTER,
    activate,
    add_old_adapter,
    check_final_latents,
    ema_update,
    noised_samples,
    training_sigmas,
    training_units,
)
from diffrl.engines.train.setup import (
    ADAPTER_NAME,
    build_optimizer,
    build_scheduler,
    check_offload,
    prepare_denoiser,
    shard,
    trained_module,
    world,
)
from diffrl.engines.trajectories import Trajectories
from diffrl.models.base import ModelAdapter, SampleShape

TRAINED_DATA = ("denoising_steps", "final_samples")  # the Needs.data this trainer feeds


class PolicyTrainer(TrainerBase):
    """Owns the trainable denoiser (LoRA or full), its optimizer/schedule, checkpoints and weight sync, and trains
    every diffusion algorithm (its needs.data is "denoising_steps" or "final_samples").

    The adapter is modified in place (LoRA injected, FSDP2-sharded when world size > 1), so a
    RolloutEngine on the same adapter samples with the trained weights without a copy.
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        algorithm: Algorithm,
        cfg: TrainConfig,
        sampling: SamplingConfig,
        *,
        group_size: int,
        device: str | torch.device | None = None,
        replicate: bool = False,
        behaviour: bool = False,
        teacher: torch.nn.Module | None = None,
    ):
        """`teacher`: the frozen denoiser an algorithm whose needs.teacher distils (diffrl/engines/train/teacher.py).
        `replicate`: with world size > 1, keep whole parameters on every rank and all-reduce the gradients (engine
        replicas training LoRA, whose rollouts sample with this module) instead of sharding them. `behaviour`: an
        asynchronous run's behaviour copy of the policy (`rollout_copy`: diffrl/engines/train/sync.behaviour_copy),
        sharing this module's frozen tensors."""
        if algorithm.needs.data not in TRAINED_DATA:
            raise ValueError(
                f"algorithm {algorithm.name!r} trains on {algorithm.needs.data}; PolicyTrainer trains a diffusion "
                f"model on {' or '.join(TRAINED_DATA)} (token algorithms need an autoregressive trainer)"
            )
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1; got {group_size}")
        check_offload(cfg)
        if algorithm.needs.teacher != (teacher is not None):
            raise ValueError(
                f"algorithm {algorithm.name!r} {'needs' if algorithm.needs.teacher else 'takes no'} teacher model "
                "(model.teacher)"
            )
        self.teacher = teacher
        self.adapter, self.algorithm, self.cfg, self.sampling = adapter, algorithm, cfg, sampling
        self.group_size = group_size
        self.device = torch.device(device) if device is not None else adapter.device
        adapter.device = self.device
        self.rank, self.world_size = world()
        prepare_denoiser(adapter, cfg, self.device)
        if algorithm.needs.old_adapter:
            add_old_adapter(adapter, cfg, algorithm.name)
        self.reference = self._build_reference()
        # a wrapped module cannot be copied: engine replicas take the behaviour copy before FSDP2 wraps the denoiser
        frame = sync.behaviour_frame(adapter) if behaviour and self.world_size > 1 else None
        if self.world_size > 1:
            shard(adapter, cfg, self.device, replicate=replicate)
        # one optimizer (and one gradient clip) over every denoiser's trainable parameters (both Wan2.2 experts)
        self.params = [p for p in trained_module(adapter).parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.optimizer_steps = 0  # optimizer steps taken (skipped ones excluded)
        self.updates = 0  # update() calls, i.e. RL steps trained
        self._version = 0
        # the trainer's own replays
        self.replayer = RolloutEngine(adapter, progress=False)
        self.last_exported: dict[str, torch.Tensor] = {}  # what the last weight export sent (sync.export_weights)
        # A data-parallel replica's rollout adapter: an unsharded copy of this denoiser in this process that every
        # weight sync loads (diffrl/engines/train/sync.py), so its samples carry this policy's numerics.
        self.rollout_copy: ModelAdapter | None = None
        if behaviour:  # its own LoRA tensors, loaded by each weight sync
            self.rollout_copy = sync.behaviour_copy(adapter) if frame is None else sync.bind_frozen(frame, adapter)
        self._stepped_since_sync = False
        self._kl_gate: torch.Tensor | None = None  # the update's per-sample KL gate (needs.reward_gate)
        self._teacher_targets: OldPolicy | None = None  # the teacher's means and velocities of the update's steps

    # ---- setup helpers -------------------------------------------------------------------------
    def _build_reference(self):
        """Full fine-tuning with a reference policy: a frozen copy of the initial denoiser (optionally on CPU)."""
        needs = self.algorithm.needs
        if self.cfg.lora or not needs.reference or needs.moving_reference:
            return None
        if len(self.adapter.denoisers()) > 1:
            raise ValueError(
                f"{self.adapter.arch}: full fine-tuning (lora: false) of {len(self.adapter.denoisers())} denoisers "
                f"with a reference policy (algorithm {self.algorithm.name!r}) is not supported: use lora: true (its "
                "reference is each expert with LoRA off), or an algorithm without a reference (e.g. kl_coef: 0)"
            )
        ref = copy.deepcopy(self.adapter.transformer).requires_grad_(False).eval()
        if self.cfg.offload_reference:
            ref.to("cpu")
        elif self.world_size > 1:
            shard(self.adapter, self.cfg, self.device, module=ref)
        return ref

    # ---- the policies the update reads -----------------------------------------------------------
    @contextlib.contextmanager
    def reference_policy(self):
        """Within it, the adapter runs the reference policy (no autograd): LoRA off, or the frozen copy; the "old"
        adapter when the reference moves with the policy (needs.moving_reference)."""
        if self.algorithm.needs.moving_reference:
            with self.old_policy():
                yield
            return
        if self.cfg.lora:
            with torch.no_grad(), contextlib.ExitStack() as stack:
                for denoiser in self.adapter.denoisers():
                    stack.enter_context(lora_disabled(denoiser))
                yield
            return
        with frozen_denoiser(self.adapter.pipe, self.reference, self.device, self.cfg.offload_reference):
            yield

    @contextlib.contextmanager
    def teacher_policy(self):
        """Within it, the adapter runs the teacher's denoiser (no autograd); the teacher sleeps on the CPU outside it
        when the trainer is on an accelerator."""
        with frozen_denoiser(self.adapter.pipe, self.teacher, self.device, self.device.type != "cpu"):
            yield

    @contextlib.contextmanager
    def old_policy(self):
        """Within it, the adapter runs the "old" LoRA adapter (no autograd); only when needs.old_adapter."""
        with torch.no_grad():
            for denoiser in self.adapter.denoisers():
                activate(denoiser, OLD_ADAPTER)
            try:
                yield
            finally:
                for denoiser in self.adapter.denoisers():
                    activate(denoiser, ADAPTER_NAME)

    # ---- the update ----------------------------------------------------------------------------
    def update(
        self,
        traj: Trajectories,
        advantages: torch.Tensor,
        rollout: RolloutEngine | None = None,
        kl_gate: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One RL step's update with the algorithm's loss; returns its metrics (docs/training.md, "Metrics").

        `traj` and `advantages` (B,) are the whole step's, identical on every rank; each rank trains
        on its share of every mini-batch. `rollout` is the engine that sampled `traj`: when it runs
        on this trainer's adapter at the current policy version its log-probs are the old ones. `kl_gate` (B,) bool:
        the samples that pay the KL, for an algorithm whose needs.reward_gate.
        """
        started = time.perf_counter()
        advantages = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1).cpu()
        if advantages.shape[0] != len(traj):
            raise ValueError(f"advantages has {advantages.shape[0]} entries but traj has {len(traj)} samples")
        if self.algorithm.needs.reward_gate and (kl_gate is None or kl_gate.reshape(-1).shape[0] != len(traj)):
            raise ValueError(f"algorithm {self.algorithm.name!r} needs kl_gate, one flag per sample ({len(traj)})")
        self._kl_gate = None if kl_gate is None else torch.as_tensor(kl_gate).reshape(-1).bool().cpu()
        engine = rollout if rollout is not None and rollout.adapter is self.adapter else self.replayer
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        if self.algorithm.needs.data == "final_samples":
            self._train_final_samples(traj, advantages, engine, sums, counts)
        else:
            self._train_denoising_steps(traj, advantages, rollout, engine, sums, counts)
        self.updates += 1
        if self.algorithm.needs.old_adapter:
            for denoiser in self.adapter.denoisers():
                ema_update(denoiser, self.algorithm.old_adapter_decay(self.updates))
        metrics = _reduce_metrics(sums, counts)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        metrics["timing_s/update_actor"] = time.perf_counter() - started
        return metrics

    def _mini_batches(self, num_units: int, mini: int):
        """(epoch, start, units of one mini-batch) in training order: each PPO epoch a new permutation."""
        for epoch in range(self.cfg.ppo_epochs):
            order = self._order(num_units, epoch)
            for start in range(0, num_units, mini):
                yield epoch, start, order[start : start + mini]

    def _order(self, batch: int, epoch: int) -> torch.Tensor:
        """Sample order of one PPO epoch: a permutation keyed by (seed, update, epoch), identical on all ranks."""
        if not self.cfg.shuffle:
            return torch.arange(batch)
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.updates * 1009 + epoch)
        return torch.randperm(batch, generator=gen)

    # ---- denoising steps (needs.data "denoising_steps") -----------------------------------------
    def _replay_fn(self, engine: RolloutEngine):
        def replay(sub: Trajectories, j: int, encodings=None):
            enc, neg = (
                encodings if encodings is not None else engine.encode(sub.prompts, self.sampling, sub.metadata)[:2]
            )
            return engine.replay(sub, j, self.sampling, encoding=enc, negative=neg)

        return replay

    def _reference_step(self, replay, sub: Trajectories, j: int, encodings):
        with self.reference_policy():
            return replay(sub, j, encodings)

    def _old_policy(self, traj: Trajectories, engine: RolloutEngine, same_numerics: bool) -> OldPolicy:
        needs = self.algorithm.needs
        if needs.old_means or (needs.old_log_probs and self.cfg.recompute_old_log_probs(same_numerics)):
            return recompute_old_policy(traj, self._replay_fn(engine), self.cfg, with_means=needs.old_means)
        return OldPolicy(traj.log_probs)

    def _train_denoising_steps(self, traj, advantages, rollout, engine, sums, counts) -> None:
        """Every PPO epoch and mini-batch of the step's samples, replaying their trained window steps."""
        # Rollout log-probs are the old policy's only if they came from these very weights, run as the replay runs
        # them (not on rollout.weights' merged/fp8 copy in the window steps: the run's sampling config says).
        same_numerics = (
            rollout is not None
            and (rollout.adapter is self.adapter or rollout.adapter is self.rollout_copy)
            and traj.policy_version == self._version
            and not self._stepped_since_sync
            and self.sampling.weights.trainer_numerics
        )
        old = self._old_policy(traj, engine, same_numerics)
        self._teacher_targets = None
        if self.algorithm.needs.teacher:  # the teacher wakes once per update and scores every trained step
            started = time.perf_counter()
            with self.teacher_policy():
                self._teacher_targets = recompute_old_policy(
                    traj, self._replay_fn(engine), self.cfg, with_means=True, with_velocities=True
                )
            _add_values(sums, counts, {"timing_s/teacher": time.perf_counter() - started})
        if old.recomputed:
            _add_gap(sums, counts, old.log_probs, traj.log_probs, traj.trained)
            _add_values(sums, counts, correction_stats(old.log_probs, traj.log_probs, traj.trained, self.cfg))
        mini = self.cfg.mini_batch_prompts * self.group_size
        for epoch, start, rows in self._mini_batches(len(traj), mini):
            measure_gap = not old.recomputed and epoch == 0 and start == 0
            self._steps_mini_batch(traj, rows, advantages, old, engine, sums, counts, measure_gap)

    def _steps_mini_batch(self, traj, rows, advantages, old: OldPolicy, engine, sums, counts, measure_gap) -> None:
        """Forward/backward every micro-batch and trained step of one mini-batch, then one optimizer step."""
        local = rank_rows(rows)
        steps = active_steps(traj.trained[rows])
        num_trained = traj.trained[rows].sum(dim=1).float().mean().item()  # T (equal per sample in every policy)
        replay = self._replay_fn(engine)
        self.optimizer.zero_grad(set_to_none=True)
        replayed = []  # (replayed log-probs on the device, rollout log-probs, trained mask) per pass, for the gap
        for mb in range(0, len(local), self.cfg.micro_batch_size):
            idx = local[mb : mb + self.cfg.micro_batch_size]
            sub = traj.select(idx)
            encodings = engine.encode(sub.prompts, self.sampling, sub.metadata)[:2]
            for j in steps:
                out = replay(sub, j, encodings)
                batch = self._step_batch(replay, sub, j, encodings, out, idx, traj, old, advantages)
                loss, step_metrics = self.algorithm.loss(batch)
                (loss * (len(idx) / (len(local) * num_trained))).backward()
                _accumulate(sums, counts, step_metrics)
                if measure_gap:
                    replayed.append((out.log_prob.detach(), traj.log_probs[idx, j], sub.trained[:, j]))
        if replayed:  # one copy to the host for the mini-batch (the optimizer step waits for the GPU anyway)
            device_parts, rollout_parts, trained_parts = zip(*replayed)
            _add_gap(
                sums,
                counts,
                torch.cat(device_parts).float().cpu()[:, None],
                torch.cat(rollout_parts)[:, None],
                torch.cat(trained_parts)[:, None],
            )
        self._optimizer_step(sums, counts)

    def _step_batch(self, replay, sub, j: int, encodings, out, idx, traj, old: OldPolicy, advantages) -> StepBatch:
        """Window step j of one micro-batch as the algorithm's StepBatch (reference forward when it needs one)."""
        needs = self.algorithm.needs
        weights = correction_weights(old.log_probs[idx, j], traj.log_probs[idx, j], self.cfg)
        mask = sub.trained[:, j].float()
        weights = mask if weights is None else weights * mask
        device = out.log_prob.device
        ref = self._reference_step(replay, sub, j, encodings) if needs.reference else None
        teacher = self._teacher_targets
        return StepBatch(  # host -> device copies queued behind the forward, not waited for (to_device)
            log_prob=out.log_prob,
            old_log_prob=to_device(old.log_probs[idx, j], device),
            advantages=to_device(advantages[idx], device),
            prev_sample_mean=out.prev_sample_mean,
            std_dev_t=out.std_dev_t,
            sqrt_dt=out.sqrt_dt,
            weights=to_device(weights, device),
            old_prev_sample_mean=None if old.means is None else to_device(old.means[idx, j], device),
            ref_prev_sample_mean=None if ref is None else ref.prev_sample_mean,
            kl_gate=None if self._kl_gate is None else to_device(self._kl_gate[idx], device),
            velocity=out.velocity,
            ref_velocity=None if ref is None else ref.velocity,
            teacher_prev_sample_mean=None if teacher is None else to_device(teacher.means[idx, j], device),
            teacher_velocity=None if teacher is None else to_device(teacher.velocities[idx, j], device),
        )

    # ---- final samples (needs.data "final_samples") ---------------------------------------------
    def _train_final_samples(self, traj, advantages, engine, sums, counts) -> None:
        """Every PPO epoch and mini-batch of the step's final samples (or pairs of them), re-noised per epoch."""
        n = self.sampling.num_inference_steps
        check_final_latents(traj, n, self.algorithm.name)
        shape = SampleShape(self.sampling.height, self.sampling.width, self.sampling.num_frames, self.sampling.duration)
        sigmas_N = self.adapter.sigmas(n, shape).float().cpu()
        needs = self.algorithm.needs
        sigmas_N = training_sigmas(sigmas_N, needs.highest_sigmas)
        units = training_units(advantages, traj.group_ids, needs.pairs, needs.groups)
        mini = self.cfg.mini_batch_prompts * (1 if needs.pairs or needs.groups else self.group_size)
        # a unit is a sample, a pair or a whole group; micro_batch_size counts samples (pairs for pair algorithms),
        # so a micro-batch of an algorithm on groups holds as many whole groups as fit, at least one
        micro = max(1, self.cfg.micro_batch_size // self.group_size) if needs.groups else self.cfg.micro_batch_size
        for epoch, _, picked in self._mini_batches(len(units), mini):
            local = rank_rows(picked)
            local_rows = sum(len(units[int(u)]) for u in local)
            self.optimizer.zero_grad(set_to_none=True)
            for mb in range(0, len(local), micro):
                chunk = [units[int(u)] for u in local[mb : mb + micro]]
                batch = self._sample_batch(traj, chunk, advantages, engine, sigmas_N, shape, epoch)
                loss, metrics = self.algorithm.loss(batch)
                # the micro-batch's loss is a mean over its rows (pairs: over pairs, two rows each)
                (loss * (sum(len(unit) for unit in chunk) / local_rows)).backward()
                _accumulate(sums, counts, metrics)
            self._optimizer_step(sums, counts)

    def _noised(self, x0: torch.Tensor, seeds: torch.Tensor, sigmas_N: torch.Tensor, epoch: int):
        """Per sample (sigma (b,), x_t, target) on the device, keyed by (cfg.seed, update, epoch, sample seed): each
        PPO epoch trains every sample at a new noise level, as DiffusionNFT trains several timesteps per sample."""
        key = self.cfg.seed * 1_000_003 + self.updates * 7_919 + epoch * 104_729
        draw = self.algorithm.draw_sigma if self.algorithm.needs.draws_sigmas else None
        sigma, x_t, target = noised_samples(x0, seeds, sigmas_N, key, draw)
        return to_device(sigma, self.device), to_device(x_t, self.device), to_device(target, self.device)

    def _velocity(self, x_t, sigma, encoding, shape: SampleShape) -> torch.Tensor:
        """The conditional velocity (guidance scale 1, no negative prompt), as the published code trains it."""
        with self.adapter.attention_context():
            return self.adapter.velocity(x_t, sigma, encoding, None, guidance_scale=1.0, shape=shape)

    def _sample_batch(self, traj, chunk: list[list[int]], advantages, engine, sigmas_N, shape, epoch) -> SampleBatch:
        """One micro-batch of units (samples, or (chosen, rejected) pairs) as the algorithm's SampleBatch."""
        needs = self.algorithm.needs
        rows = [i for unit in chunk for i in unit]
        sub = traj.select(rows)
        x0 = sub.latents[:, -1]
        # A pair (a group) shares its noise and noise level: key every row by the unit's first sample's seed.
        key_seeds = torch.tensor([traj.seeds[unit[0]] for unit in chunk for _ in unit])
        sigma, x_t, target = self._noised(x0, key_seeds, sigmas_N, epoch)
        encoding = engine.encode(sub.prompts, self.sampling, sub.metadata)[0]
        velocity = self._velocity(x_t, sigma, encoding, shape)
        ref_velocity = old_velocity = None
        if needs.reference:
            with self.reference_policy():
                ref_velocity = self._velocity(x_t, sigma, encoding, shape)
        if needs.old_adapter:
            with self.old_policy():
                old_velocity = self._velocity(x_t, sigma, encoding, shape)
        return SampleBatch(
            velocity=velocity,
            target=target,
            x_t=x_t,
            x0=to_device(x0, self.device),
            sigma=sigma,
            advantages=to_device(advantages[rows], self.device),
            old_velocity=old_velocity,
            ref_velocity=ref_velocity,
            group_index=torch.tensor([g for g, unit in enumerate(chunk) for _ in unit], device=self.device)
            if needs.groups
            else None,
        )

    def export_lora(self, path: str) -> str:
        """The LoRA weights as a diffusers `load_lora_weights` folder at `path` (fsspec)."""
        return checkpoint.export_lora(self, path)

    def sync_weights(self, rollout) -> dict[str, float]:
        """Make `rollout` sample with the current weights; bumps policy_version. Returns timing_s/sync_weights."""
        return sync.sync_weights(self, rollout)


def _accumulate(sums, counts, metrics: dict) -> None:
    """Add one pass's metrics without waiting for the GPU: tensors are summed where they are (in float64, as
    Python floats would add them) and read once, when the update's metrics are reduced. A float() per pass would hold
    the host until that pass's backward had run, and the GPU would idle while the host prepared the next pass."""
    for name, value in metrics.items():
        sums[name] = sums[name] + (value.detach().double() if torch.is_tensor(value) else float(value))
        counts[name] += 1


def _add_gap(sums, counts, replayed: torch.Tensor, rollout: torch.Tensor, trained: torch.Tensor) -> None:
    """rollout_corr/logprob_abs_diff_{mean,max} over trained steps ((n, W) tensors)."""
    diff = (replayed - rollout).abs()[trained]
    # Keys are set even for an empty selection: every rank must reduce the same metric names.
    sums["rollout_corr/logprob_abs_diff_mean"] += float(diff.sum())
    counts["rollout_corr/logprob_abs_diff_mean"] += diff.numel()
    top = float(diff.max()) if diff.numel() else 0.0
    sums["rollout_corr/logprob_abs_diff_max"] = max(sums["rollout_corr/logprob_abs_diff_max"], top)
    counts["rollout_corr/logprob_abs_diff_max"] = 1


def _add_values(sums, counts, values: dict[str, float]) -> None:
    """Metrics computed once per update (not a mean over passes); `_max` and `_min` stay what they are."""
    for name, value in values.items():
        sums[name] += value
        counts[name] = 1


def _reduce_metrics(sums: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
    """Means of the accumulated metrics (max/count kept as they are), averaged over ranks."""
    names = sorted(sums)
    local = {n: float(sums[n]) / max(counts[n], 1) for n in names}  # device sums (see _accumulate) read here, once
    _, size = world()
    if size == 1 or not names:
        return local
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    out = {}
    for op, group in (
        (dist.ReduceOp.MAX, [n for n in names if n.endswith("_max")]),
        (dist.ReduceOp.SUM, [n for n in names if not n.endswith("_max")]),
    ):
        if not group:
            continue
        values = torch.tensor([local[n] for n in group], dtype=torch.float64, device=device)
        dist.all_reduce(values, op=op)
        scale = 1.0 if op == dist.ReduceOp.MAX else 1.0 / size
        out.update({n: float(v) * scale for n, v in zip(group, values.cpu())})
    return out
