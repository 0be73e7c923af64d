"""RunAhead (diffrl/engines/step/ahead.py): each stage run happens once per process, whoever asks first; a failure
reaches every caller; after forget_failures a retry runs the stage again."""

from __future__ import annotations

import threading

import pytest

from diffrl.engines.step.ahead import RunAhead


def test_a_stage_run_asked_for_twice_runs_once_and_both_callers_get_its_record():
    ahead = RunAhead()
    calls, started, release = [], threading.Event(), threading.Event()

    def stage():
        calls.append(1)
        started.set()
        release.wait(5)
        return {"rows": 8}

    # the worker runs the stage; the flow's task asks for the same run while it is still going
    ahead.start(3, lambda: ahead.once(("generate", 3, 0, None), stage))
    assert started.wait(5)
    got = []
    caller = threading.Thread(target=lambda: got.append(ahead.once(("generate", 3, 0, None), stage)))
    caller.start()
    release.set()
    caller.join(5)
    ahead.wait()
    assert got == [{"rows": 8}] and len(calls) == 1
    assert ahead.once(("generate", 4, 0, None), lambda: "other step") == "other step"  # another key runs
    ahead.close()


def test_a_failed_stage_fails_the_later_caller_until_forgotten():
    ahead = RunAhead()
    attempts = []

    def flaky():
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("injected fault at update_actor")
        return "trained"

    ahead.start(1, lambda: ahead.once(("update_actor", 1, 0, None), flaky))
    ahead.wait()  # the worker swallowed the error: the flow's task must see it
    with pytest.raises(RuntimeError, match="injected fault"):
        ahead.once(("update_actor", 1, 0, None), flaky)
    assert len(attempts) == 1
    ahead.forget_failures()
    assert ahead.once(("update_actor", 1, 0, None), flaky) == "trained"
    assert len(attempts) == 2
    ahead.done_before(2)  # step 1's runs forgotten: asked again, it runs again
    assert ahead.once(("update_actor", 1, 0, None), flaky) == "trained" and len(attempts) == 3
    ahead.close()


def test_a_stopped_run_ahead_starts_no_stage_and_close_does_not_wait_for_the_running_one():
    """After an interrupt: the stage running on the worker ends on its own; nothing starts after it."""
    ahead, started, release = RunAhead(), threading.Event(), threading.Event()

    def long_stage():
        started.set()
        release.wait(5)

    ahead.start(3, lambda: ahead.once(("update_actor", 3, 0, None), long_stage))
    assert started.wait(5)
    ahead.stop()
    with pytest.raises(RuntimeError, match="the run is stopping"):
        ahead.once(("sync_weights", 3, 0, None), lambda: "not run")
    ahead.close()  # returns while long_stage still runs
    assert not release.is_set()
    release.set()
