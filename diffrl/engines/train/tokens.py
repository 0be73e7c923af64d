"""The trainer of an autoregressive policy: updates a causal LM / VLM with any token algorithm by asking it, as
PolicyTrainer does for the diffusion family (`algorithm.needs` says what to prepare, `algorithm.loss(TokenBatch)`
computes a micro-batch's loss; no algorithm is named here).

The shared helpers build and save it: LoRA or full fine-tuning, optimizer and LR schedule (engines/train/setup.py),
checkpoints (engines/train/checkpoint.py), the finite-weights check. The policy (diffrl/models/causal_lm/policy.py)
answers what those helpers ask of an adapter.

Legend: B samples of a step, M = mini_batch_prompts x group_size samples per optimizer step (mini_batch_prompts pairs
for pair algorithms), b samples of a micro-batch, T response tokens (right-padded).

Loss scaling: each micro-batch's loss is the algorithm's aggregate over its b samples; it is multiplied by b / M
before its backward, so one optimizer step sees the mean over its micro-batches weighted by their sizes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections import defaultdict

import torch

from diffrl.algorithms.base import Algorithm
from diffrl.algorithms.batches import TokenBatch
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout.engine import to_device
from diffrl.engines.rollout.tokens import TokenSampling
from diffrl.engines.token_trajectories import TokenTrajectories
from diffrl.engines.train.base import TrainerBase
from diffrl.engines.train.policy_loss import correction_stats, correction_weights, lora_disabled
from diffrl.engines.train.preference import training_units
from diffrl.engines.train.setup import build_optimizer, build_scheduler, check_offload, prepare_denoiser, world
from diffrl.engines.train.trainer import _accumulate, _add_gap, _add_values, _reduce_metrics
from diffrl.models.causal_lm.policy import CausalLMPolicy


class TokenTrainer(TrainerBase):
    """Owns the trainable causal LM (LoRA or full), its optimizer/schedule, checkpoints and weight sync; trains every
    algorithm whose needs.data is "tokens". The policy's module is trained in place, so an in-process rollout on the
    same policy samples with the trained weights without a copy."""

    def __init__(
        self,
        policy: CausalLMPolicy,
        algorithm: Algorithm,
        cfg: TrainConfig,
        sampling: TokenSampling,
        *,
        group_size: int,
        device: str | torch.device | None = None,
    ):
        if algorithm.needs.data != "tokens":
            raise ValueError(
                f"algorithm {algorithm.name!r} trains on {algorithm.needs.data}; TokenTrainer trains an autoregressive "
                "model on tokens (diffusion algorithms need a diffusion model: PolicyTrainer)"
            )
        self.rank, self.world_size = world()
        if self.world_size > 1:
            raise ValueError("TokenTrainer trains in one process for now (cluster.gpus: 1)")
        check_offload(cfg)
        self.adapter, self.algorithm, self.cfg, self.sampling = policy, algorithm, cfg, sampling
        self.group_size = group_size
        self.device = torch.device(device) if device is not None else policy.device
        # transformers names its checkpointing switch differently from diffusers: set it here, not in the helper
        prepare_denoiser(policy, dataclasses.replace(cfg, gradient_checkpointing=False), self.device)
        if cfg.gradient_checkpointing:
            policy.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.reference = None
        if algorithm.needs.reference and not cfg.lora:  # full fine-tuning: a frozen copy of the initial weights
            self.reference = copy.deepcopy(policy.model).requires_grad_(False).eval()
            if cfg.offload_reference:
                self.reference.to("cpu")
        self.params = [p for p in policy.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg)
        init_optimizer_state(self.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.optimizer_steps = 0
        self.updates = 0
        self._version = 0
        self._stepped_since_sync = False
        self.last_exported: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def reference_policy(self):
        """Within it, the policy runs the reference weights (no autograd): LoRA off, or the frozen copy."""
        with torch.no_grad():
            if self.cfg.lora:
                with lora_disabled(self.adapter.model):
                    yield
                return
            trained, self.adapter.model = self.adapter.model, self.reference.to(self.device)
            try:
                yield
            finally:
                self.adapter.model = trained
                if self.cfg.offload_reference:
                    self.reference.to("cpu")

    # ---- the update -------------------------------------------------------------------------------------
    def update(self, traj: TokenTrajectories, advantages: torch.Tensor, rollout=None) -> dict[str, float]:
        """One RL step's update of the policy on `traj` (the rows the step core picked) and their advantages (B,);
        returns actor/*, rollout_corr/* and timing metrics. `rollout` is the engine that sampled `traj`."""
        started = time.perf_counter()
        advantages = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1).cpu()
        if advantages.shape[0] != len(traj):
            raise ValueError(f"advantages has {advantages.shape[0]} entries but traj has {len(traj)} samples")
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        if len(traj):
            self._train(traj, advantages, rollout, sums, counts)
        self.updates += 1
        metrics = _reduce_metrics(sums, counts)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        metrics["timing_s/update_actor"] = time.perf_counter() - started
        return metrics

    def _train(self, traj: TokenTrajectories, advantages, rollout, sums, counts) -> None:
        """Every PPO epoch and mini-batch of the step's samples (or pairs), one optimizer step per mini-batch."""
        response_ids, rollout_log_probs, mask = traj.padded()
        same_numerics = (
            rollout is not None
            and getattr(rollout, "adapter", None) is self.adapter
            and traj.policy_version == self._version
            and not self._stepped_since_sync
        )
        old = rollout_log_probs
        if self.algorithm.needs.old_log_probs and self.cfg.recompute_old_log_probs(same_numerics):
            old = self._forward_all(traj, response_ids)
            _add_gap(sums, counts, old, rollout_log_probs, mask.bool())
            _add_values(sums, counts, correction_stats(old, rollout_log_probs, mask, self.cfg))
        pairs = self.algorithm.needs.pairs
        units = training_units(advantages, traj.group_ids, pairs)
        mini = self.cfg.mini_batch_prompts * (1 if pairs else self.group_size)
        for epoch in range(self.cfg.ppo_epochs):
            order = self._order(len(units), epoch)
            for start in range(0, len(units), mini):
                rows = [i for u in order[start : start + mini].tolist() for i in units[u]]
                measure_gap = old is rollout_log_probs and epoch == 0 and start == 0
                self._mini_batch(
                    traj, rows, (response_ids, rollout_log_probs, mask, old), advantages, sums, counts, measure_gap
                )

    def _order(self, num_units: int, epoch: int) -> torch.Tensor:
        """Unit order of one PPO epoch: a permutation keyed by (seed, update, epoch)."""
        if not self.cfg.shuffle:
            return torch.arange(num_units)
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.updates * 1009 + epoch)
        return torch.randperm(num_units, generator=gen)

    def _mini_batch(self, traj, rows: list[int], tensors, advantages, sums, counts, measure_gap: bool) -> None:
        """Forward/backward every micro-batch of one mini-batch (pairs stay whole), then one optimizer step."""
        response_ids, rollout_log_probs, mask, old = tensors
        step = self.cfg.micro_batch_size + (self.cfg.micro_batch_size % 2 if self.algorithm.needs.pairs else 0)
        self.optimizer.zero_grad(set_to_none=True)
        for mb in range(0, len(rows), step):
            idx = rows[mb : mb + step]
            width = int(mask[idx].sum(dim=1).max().clamp_min(1))
            ids, token_mask = response_ids[idx, :width], mask[idx, :width]
            log_probs, entropy = self._replay(traj.select(idx), ids, entropy=True)
            ref = None
            if self.algorithm.needs.reference:
                with self.reference_policy():
                    ref = self._replay(traj.select(idx), ids)[0]
            weights = correction_weights(old[idx, :width], rollout_log_probs[idx, :width], self.cfg)
            device_mask = to_device(token_mask, self.device)
            batch = TokenBatch(  # host -> device copies queued behind the forward, not waited for (to_device)
                log_probs=log_probs,
                old_log_probs=to_device(old[idx, :width], self.device),
                mask=device_mask,
                advantages=to_device(advantages[idx], self.device),
                ref_log_probs=ref,
                weights=None if weights is None else to_device(weights, self.device),
            )
            loss, step_metrics = self.algorithm.loss(batch)
            (loss * (len(idx) / len(rows))).backward()
            entropy_mean = (entropy.detach() * device_mask).sum() / device_mask.sum().clamp_min(1)
            # summed on the device and read once at the update's end (a float() here waited for this pass's backward)
            _accumulate(sums, counts, {**step_metrics, "actor/entropy": entropy_mean})
            if measure_gap:
                _add_gap(
                    sums, counts, log_probs.detach().float().cpu(), rollout_log_probs[idx, :width], token_mask.bool()
                )
        self._optimizer_step(sums, counts)

    def _replay(self, sub: TokenTrajectories, response_ids: torch.Tensor, *, entropy: bool = False):
        """(log-probs (b, T), entropy or None) of `sub`'s responses under the policy's current weights."""
        inputs = self.adapter.inputs_from_ids(sub.prompt_ids, sub.image_paths, sub.audio_paths)
        return self.adapter.replay(inputs, response_ids, temperature=self.sampling.temperature, entropy=entropy)

    @torch.no_grad()
    def _forward_all(self, traj: TokenTrajectories, response_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) log-probs of every sample under the current weights, before any optimizer step (the old policy)."""
        out = torch.zeros(response_ids.shape, dtype=torch.float32)
        size = self.cfg.micro_batch_size
        for start in range(0, len(traj), size):
            idx = list(range(start, min(start + size, len(traj))))
            out[idx] = self._replay(traj.select(idx), response_ids[idx])[0].float().cpu()
        return out * traj.padded()[2]  # padding positions hold 0, as the rollout's padded log-probs do

    def sync_weights(self, rollout) -> dict[str, float]:
        """The in-process rollout shares this module: the policy version moves (and the rollout learns it)."""
        started = time.perf_counter()
        self.mark_synced()
        if rollout is not None:
            rollout.update_weights(self._version)
        return {"timing_s/sync_weights": time.perf_counter() - started, "sync/policy_version": float(self._version)}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Every parameter's optimizer state now, as AdamW makes it at a parameter's first update (zero moments, step
    0), instead of at that update: a checkpoint then holds the state of every trained parameter, also of those no
    update reached (a text-only run never reaches the Thinker's vision and audio towers), and a resumed optimizer
    loads into the same keys (torch's DCP otherwise finds the towers' state missing from the checkpoint)."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # the step below must not move a weight (AdamW's decay is lr x weight_decay too)
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        state["step"].zero_()  # the zero-gradient step above does not count
