"""`diffrl`'s defaults for the libraries it drives (diffrl/flows/cli.quiet_libraries): Prefect's telemetry is off unless
the user says otherwise, and a user's own setting wins."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prefect._internal.analytics.ci_detection import CI_ENV_VARS
from prefect._internal.analytics.enabled import is_telemetry_enabled

from diffrl.flows.cli import quiet_libraries


def test_prefect_telemetry_is_off_by_default_and_a_users_setting_wins(monkeypatch):
    for name in ("DO_NOT_TRACK", "PREFECT_SERVER_ANALYTICS_ENABLED", *CI_ENV_VARS):  # Prefect turns it off in CI
        monkeypatch.delenv(name, raising=False)
    # Prefect's own check (no banner, no reports), as `diffrl train` leaves the process
    quiet_libraries(verbose=False)
    assert not is_telemetry_enabled()
    monkeypatch.setenv("DO_NOT_TRACK", "0")  # exported by the user before `diffrl ...`
    quiet_libraries(verbose=True)
    assert is_telemetry_enabled()


CRASH = """
from diffrl.flows.cli import quiet_libraries
quiet_libraries(verbose={verbose})
from prefect.logging.configuration import setup_logging
from prefect.logging.loggers import get_logger
setup_logging()  # as Prefect configures its loggers in a run
get_logger("engine").error("Crash detected! Execution was aborted by an interrupt signal.")
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_prefects_engine_crash_line_stays_out_of_the_console_unless_verbose(verbose):
    """An interrupt that lands while Prefect sets a task run up is logged by its engine's own logger (not the run's):
    a fresh process, Prefect's logging set up as in a run, that logger's error line."""
    out = subprocess.run([sys.executable, "-c", CRASH.format(verbose=verbose)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert ("Crash detected!" in out.stderr + out.stdout) == verbose, out.stderr
