"""The policy-gradient trainer: replays stored denoising steps and updates the policy (DESIGN §3).

Legend: B samples of one RL step (the same Trajectories on every rank), M = mini_batch_prompts x
group_size samples per optimizer step (over all ranks), b samples per micro-batch (one rank),
W window steps, T trained steps per sample.

Loss scaling: each (micro-batch, step) loss is a mean over its b samples; it is multiplied by
b / (M_local x T) before its own backward, so one optimizer step sees the mean over all of its
samples and trained steps -- "loss / (micro-batches x steps)" when micro-batches are equal -- and
FSDP's gradient averaging over ranks makes 1 and N processes compute the same update.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from diffrl.algorithms.catalog import Algorithm
from diffrl.engines.rollout.config import SamplingConfig
from diffrl.engines.rollout.engine import RolloutEngine
from diffrl.engines.train import checkpoint, sync
from diffrl.engines.train.config import TrainConfig
from diffrl.engines.train.policy_loss import (
    NEEDS_OLD_MEAN,
    OldPolicy,
    active_steps,
    correction_weights,
    lora_disabled,
    rank_rows,
    recompute_old_policy,
    reference_kl,
    step_loss,
    swapped_transformer,
)
from diffrl.engines.train.setup import build_optimizer, build_scheduler, check_offload, prepare_denoiser, shard, world
from diffrl.engines.trajectories import Trajectories
from diffrl.models.base import ModelAdapter


class PolicyTrainer:
    """Owns the trainable denoiser (LoRA or full), its optimizer/schedule, checkpoints and weight sync.

    The adapter is modified in place (LoRA injected, FSDP2-sharded when world size > 1), so a
    RolloutEngine on the same adapter samples with the trained weights without a copy.
    """

    family = "policy_gradient"  # the Algorithm.family this trainer trains

    def __init__(
        self,
        adapter: ModelAdapter,
        algorithm: Algorithm,
        cfg: TrainConfig,
        sampling: SamplingConfig,
        *,
        group_size: int,
        device: str | torch.device | None = None,
    ):
        if algorithm.family != self.family:
            raise ValueError(
                f"algorithm {algorithm.name!r} is {algorithm.family}; {type(self).__name__} trains "
                f"{self.family} algorithms (PolicyTrainer: policy_gradient, "
                "DirectPreferenceTrainer: direct_preference)"
            )
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1; got {group_size}")
        check_offload(cfg)
        self.adapter, self.algorithm, self.cfg, self.sampling = adapter, algorithm, cfg, sampling
        self.group_size = group_size
        self.device = torch.device(device) if device is not None else adapter.device
        adapter.device = self.device
        self.rank, self.world_size = world()
        prepare_denoiser(adapter, cfg, self.device)
        self._extra_setup()
        self.reference = self._build_reference()
        if self.world_size > 1:
            shard(adapter, cfg, self.device)
        self.params = [p for p in adapter.transformer.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.optimizer_steps = 0  # optimizer steps taken (skipped ones excluded)
        self.updates = 0  # update() calls, i.e. RL steps trained
        self._version = 0
        self._replayer = RolloutEngine(adapter, progress=False)
        self._exported: dict[str, torch.Tensor] = {}
        self._stepped_since_sync = False

    # ---- setup helpers -------------------------------------------------------------------------
    def _extra_setup(self) -> None:
        """Hook after LoRA injection, before sharding and the optimizer (DirectPreferenceTrainer's old adapter)."""

    def _build_reference(self):
        """Full fine-tuning with KL: a frozen copy of the initial denoiser (optionally on CPU)."""
        if self.cfg.lora or not self._needs_reference():
            return None
        ref = copy.deepcopy(self.adapter.transformer).requires_grad_(False).eval()
        if self.cfg.offload_reference:
            ref.to("cpu")
        elif self.world_size > 1:
            shard(self.adapter, self.cfg, self.device, module=ref)
        return ref

    @property
    def policy_version(self) -> int:
        """Number of weight syncs done; trajectories sampled at this version need no old-policy recompute."""
        return self._version

    # ---- the update ----------------------------------------------------------------------------
    def _replay_fn(self, engine: RolloutEngine):
        def replay(sub: Trajectories, j: int, encodings=None):
            enc, neg = encodings if encodings is not None else engine.encode(sub.prompts, self.sampling)[:2]
            return engine.replay(sub, j, self.sampling, encoding=enc, negative=neg)

        return replay

    def _needs_reference(self) -> bool:
        return self.algorithm.kl_coef > 0

    @contextlib.contextmanager
    def reference_policy(self):
        """Within it, the adapter runs the reference policy (no autograd): LoRA off, or the frozen copy."""
        with torch.no_grad():
            if self.cfg.lora:
                with lora_disabled(self.adapter.transformer):
                    yield
                return
            if self.cfg.offload_reference:
                self.reference.to(self.device)
            try:
                with swapped_transformer(self.adapter.pipe, self.reference):
                    yield
            finally:
                if self.cfg.offload_reference:
                    self.reference.to("cpu")

    def _reference_step(self, replay, sub: Trajectories, j: int, encodings):
        with self.reference_policy():
            return replay(sub, j, encodings)

    def _old_policy(self, traj: Trajectories, engine: RolloutEngine, same_numerics: bool) -> OldPolicy:
        needs_mean = self.algorithm.loss in NEEDS_OLD_MEAN
        if self.cfg.recompute_old_log_probs(same_numerics) or needs_mean:
            return recompute_old_policy(traj, self._replay_fn(engine), self.cfg, with_means=needs_mean)
        return OldPolicy(traj.log_probs)

    def update(
        self, traj: Trajectories, advantages: torch.Tensor, rollout: RolloutEngine | None = None
    ) -> dict[str, float]:
        """Policy-gradient update on one RL step's trajectories; returns DESIGN §4 metrics.

        `traj` and `advantages` (B,) are the whole step's, identical on every rank; each rank trains
        on its share of every mini-batch. `rollout` is the engine that sampled `traj`: when it runs
        on this trainer's adapter at the current policy version its log-probs are the old ones.
        """
        started = time.perf_counter()
        advantages = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1).cpu()
        if advantages.shape[0] != len(traj):
            raise ValueError(f"advantages has {advantages.shape[0]} entries but traj has {len(traj)} samples")
        # Rollout log-probs are the old policy's only if they came from these very weights.
        same_numerics = (
            rollout is not None
            and rollout.adapter is self.adapter
            and traj.policy_version == self._version
            and not self._stepped_since_sync
        )
        engine = rollout if rollout is not None and rollout.adapter is self.adapter else self._replayer
        old = self._old_policy(traj, engine, same_numerics)
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        if old.recomputed:
            _add_gap(sums, counts, old.log_probs, traj.log_probs, traj.trained)
        mini = self.cfg.mini_batch_prompts * self.group_size
        for epoch in range(self.cfg.ppo_epochs):
            order = self._order(len(traj), epoch)
            for start in range(0, len(traj), mini):
                rows = order[start : start + mini]
                measure_gap = not old.recomputed and epoch == 0 and start == 0
                self._mini_batch(traj, rows, advantages, old, engine, sums, counts, measure_gap)
        self.updates += 1
        metrics = _reduce_metrics(sums, counts)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        metrics["timing_s/update_actor"] = time.perf_counter() - started
        return metrics

    def _order(self, batch: int, epoch: int) -> torch.Tensor:
        """Sample order of one PPO epoch: a permutation keyed by (seed, update, epoch), identical on all ranks."""
        if not self.cfg.shuffle:
            return torch.arange(batch)
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.updates * 1009 + epoch)
        return torch.randperm(batch, generator=gen)

    def _mini_batch(self, traj, rows, advantages, old: OldPolicy, engine, sums, counts, measure_gap: bool) -> None:
        """Forward/backward every micro-batch and trained step of one mini-batch, then one optimizer step."""
        local = rank_rows(rows)
        steps = active_steps(traj.trained[rows])
        num_trained = traj.trained[rows].sum(dim=1).float().mean().item()  # T (equal per sample in every policy)
        replay = self._replay_fn(engine)
        self.optimizer.zero_grad(set_to_none=True)
        for mb in range(0, len(local), self.cfg.micro_batch_size):
            idx = local[mb : mb + self.cfg.micro_batch_size]
            sub = traj.select(idx)
            encodings = engine.encode(sub.prompts, self.sampling)[:2]
            for j in steps:
                out = replay(sub, j, encodings)
                mask = sub.trained[:, j].float()
                weights = correction_weights(old.log_probs[idx, j], traj.log_probs[idx, j], self.cfg)
                weights = mask if weights is None else weights * mask
                old_mean = None if old.means is None else old.means[idx, j].to(self.device)
                device = out.log_prob.device
                loss, step_metrics = step_loss(
                    self.algorithm,
                    out,
                    old.log_probs[idx, j].to(device),
                    advantages[idx].to(device),
                    weights.to(device),
                    old_mean,
                )
                if self.algorithm.kl_coef > 0:
                    kl = reference_kl(out, self._reference_step(replay, sub, j, encodings))
                    loss = loss + self.algorithm.kl_coef * kl
                    step_metrics["actor/kl_loss"] = kl.detach()
                (loss * (len(idx) / (len(local) * num_trained))).backward()
                for name, value in step_metrics.items():
                    sums[name] += float(value)
                    counts[name] += 1
                if measure_gap:
                    _add_gap(
                        sums,
                        counts,
                        out.log_prob.detach().float().cpu()[:, None],
                        traj.log_probs[idx, j][:, None],
                        sub.trained[:, j][:, None],
                    )
        self._optimizer_step(sums, counts)

    def _optimizer_step(self, sums, counts) -> None:
        """Clip; skip the step (and count it) when the gradient norm is not finite."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm = float(norm)
        finite = math.isfinite(norm)
        if finite:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer_steps += 1
            self._stepped_since_sync = True
            sums["actor/grad_norm"] += norm
            counts["actor/grad_norm"] += 1
        sums["actor/skipped_steps"] += 0.0 if finite else 1.0
        counts["actor/skipped_steps"] = 1  # a count, not a mean
        self.optimizer.zero_grad(set_to_none=True)

    # ---- checkpoints and weight sync -----------------------------------------------------------
    def save_checkpoint(self, path: str, *, step: int) -> str:
        """Write LoRA (diffusers format) or full weights (DCP), optimizer, schedule, RNG and step to `path`."""
        return checkpoint.save(self, path, step=step)

    def load_checkpoint(self, path: str) -> int:
        """Restore what :meth:`save_checkpoint` wrote; returns its step."""
        return checkpoint.load(self, path)

    def export_lora(self, path: str) -> str:
        """The LoRA weights as a diffusers `load_lora_weights` folder at `path` (fsspec)."""
        return checkpoint.export_lora(self, path)

    def sync_weights(self, rollout) -> dict[str, float]:
        """Make `rollout` sample with the current weights; bumps policy_version. Returns timing_s/sync_weights."""
        return sync.sync_weights(self, rollout)


def _add_gap(sums, counts, replayed: torch.Tensor, rollout: torch.Tensor, trained: torch.Tensor) -> None:
    """rollout_corr/logprob_abs_diff_{mean,max} over trained steps ((n, W) tensors)."""
    diff = (replayed - rollout).abs()[trained]
    # Keys are set even for an empty selection: every rank must reduce the same metric names.
    sums["rollout_corr/logprob_abs_diff_mean"] += float(diff.sum())
    counts["rollout_corr/logprob_abs_diff_mean"] += diff.numel()
    top = float(diff.max()) if diff.numel() else 0.0
    sums["rollout_corr/logprob_abs_diff_max"] = max(sums["rollout_corr/logprob_abs_diff_max"], top)
    counts["rollout_corr/logprob_abs_diff_max"] = 1


def _reduce_metrics(sums: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
    """Means of the accumulated metrics (max/count kept as they are), averaged over ranks."""
    names = sorted(sums)
    local = {n: sums[n] / max(counts[n], 1) for n in names}
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
