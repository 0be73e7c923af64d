"""The weight-sync counters every trainer keeps (checkpoint.py saves and restores them)."""

from __future__ import annotations


class PolicyVersions:
    """How many weight syncs the rollout has had (`policy_version`) and whether the weights changed since the last one
    (`stepped_since_sync`); a trainer sets `_stepped_since_sync` when its optimizer steps."""

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
