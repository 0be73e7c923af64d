"""Failures of the work whose message says all there is to say: `diffrl` prints them as one line and exits 1
(bad input is a ValueError: one line, exit 2; anything else prints its traceback, exit 1)."""

from __future__ import annotations


class RunFailure(RuntimeError):
    """The run failed for a reason its message states fully (no traceback helps)."""


class DamagedRun(RunFailure):
    """A file of the run's stored data is missing or unreadable: rerunning cannot repair it."""
