"""`diffrl`'s defaults for the libraries it drives (diffrl/flows/cli.quiet_libraries): Prefect's telemetry is off unless
the user says otherwise, and a user's own setting wins."""

from __future__ import annotations

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
