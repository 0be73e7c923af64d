"""What diffrl/flows/interrupts.py reports for a signal (the commands' own interrupts: tests/e2e/test_interrupts.py)."""

from __future__ import annotations

import signal
import uuid

import pytest

from diffrl.flows import interrupts
from diffrl.flows.errors import Interrupted


def test_a_signal_is_reported_as_itself_after_an_earlier_commands_cancel():
    """A caller's second main([...]) in one process: the Cancel in the Prefect UI that stopped the first (what the
    cancel watch records) is not the reason given for a SIGTERM to the second."""
    interrupts._state.update(reason=interrupts.CANCELLED, cancelled_run=uuid.uuid4())
    with pytest.raises(Interrupted, match=r"^interrupted \(SIGTERM\)$"):
        with interrupts.signals_raise(exit_on_second=False):
            signal.raise_signal(signal.SIGTERM)  # the handler raises in this (the main) thread
