"""What every trainer shares (PolicyTrainer for diffusion steps, TokenTrainer for tokens): the weight-sync counters
checkpoint.py saves and restores, the clipped optimizer step that moves them, and the checkpoint calls."""

from __future__ import annotations

import math

import torch

from diffrl.engines.train import checkpoint


class TrainerBase:
    """How many weight syncs the rollout has had (`policy_version`) and whether the weights changed since the last one
    (`stepped_since_sync`). A subclass has `params`, `cfg.max_grad_norm`, `optimizer`, `scheduler` and
    `optimizer_steps`."""

    _version: int = 0
    _stepped_since_sync: bool = False

    @property
    def policy_version(self) -> int:
        """Number of weight syncs done; trajectories sampled at this version need no old-policy recompute."""
        return self._version

    @property
    def stepped_since_sync(self) -> bool:
        """Whether the weights changed since the rollout last received them."""
        return self._stepped_since_sync

    def mark_synced(self) -> None:
        """The rollout now samples with the current weights: one policy version more."""
        self._version += 1
        self._stepped_since_sync = False

    def restore_sync_state(self, policy_version: int, stepped_since_sync: bool) -> None:
        """The counters a checkpoint saved (engines.train.checkpoint.load)."""
        self._version, self._stepped_since_sync = policy_version, stepped_since_sync

    def _optimizer_step(self, sums, counts) -> None:
        """Clip; skip the step (and count it) when the gradient norm is not finite."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
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

    def save_checkpoint(self, path: str, *, step: int) -> str:
        """Write LoRA (diffusers format, or a PEFT folder for a causal LM) or full weights (DCP), optimizer, schedule,
        RNG and step to `path`."""
        return checkpoint.save(self, path, step=step)

    def load_checkpoint(self, path: str) -> int:
        """Restore what :meth:`save_checkpoint` wrote; returns its step."""
        return checkpoint.load(self, path)
