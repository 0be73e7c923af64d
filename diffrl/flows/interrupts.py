"""Stopping `diffrl train` on request: Ctrl-C (SIGINT), SIGTERM, or a cancel of its flow run in the Prefect UI.

1. The request becomes `Interrupted` in the main thread, wherever it waits: the signal's handler raises it
   (`signals_raise`); a cancel is seen by a thread polling the train flow run's state (`watch_cancel`), which then
   signals the main thread.
2. The flow stops the engines without waiting for the step (`stop_engines`): the run-ahead, rollout and reward workers
   start nothing more, the background writer commits what it holds for up to WRITER_S seconds (what lands is a prefix
   of the step's writes, as after a crash, which a resume reuses), Ray actors are killed (their GPUs freed). MLflow
   marks the run KILLED; the run lock is released on the way out.
3. The command stops its temporary Prefect server, prints one line and ends without waiting for threads still inside a
   stage (`end_command`, exit 130): `diffrl: interrupted at step 3 (generate); rerun the same command to resume`.

The temporary server runs in a session of its own (diffrl/flows/prefect_server.py), so a terminal's Ctrl-C reaches
`diffrl` only: the flow still needs its server to record the interruption (a server stopped by the same Ctrl-C would
leave Prefect's client retrying it for about 70 s, then a traceback). A second Ctrl-C while the first is handled ends
the process at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import uuid
from typing import Any, Iterator

from diffrl.engines.handle import EngineHandle
from diffrl.flows.errors import Interrupted

log = logging.getLogger("diffrl")

WRITER_S = 5.0  # how long an interrupted run waits for its queued writes to land
POLL_S = 1.0  # how often a run checks whether its flow run was cancelled
CANCELLED = "cancelled in the Prefect UI"

_state: dict[str, Any] = {"requests": 0, "reason": None, "cancelled_run": None}


@contextlib.contextmanager
def signals_raise(*, exit_on_second: bool) -> Iterator[None]:
    """For the `with` block, SIGINT and SIGTERM raise Interrupted in the main thread (Python's default: SIGTERM ends the
    process without a word, its lock and server left to the kernel and the server's own watch). A second signal while
    the first is handled ends the process at once where `exit_on_second` (the `diffrl` command itself)."""
    # each command starts unasked: a caller's earlier main([...]) in this process may have been cancelled or signalled
    _state.update(requests=0, reason=None, cancelled_run=None)
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        _state["requests"] += 1
        if _state["requests"] > 1 and exit_on_second:
            os.write(2, b"diffrl: interrupted again: exiting now\n")
            os._exit(130)
        named = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
        raise Interrupted(_state["reason"] or f"interrupted{named}")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def watch_cancel(flow_run_id: str | None) -> Iterator[None]:
    """While the block runs, poll the state of flow run `flow_run_id` every POLL_S seconds; once it is Cancelling (the
    Prefect UI's Cancel, `prefect flow-run cancel`), interrupt the main thread as Ctrl-C does. Only for a flow run no
    Prefect worker runs (a worker cancels its runs itself, by SIGTERM)."""
    if not flow_run_id:
        yield
        return
    done = threading.Event()
    thread = threading.Thread(target=_watch, args=(uuid.UUID(flow_run_id), done), name="diffrl-cancel", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def _watch(flow_run_id: uuid.UUID, done: threading.Event) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        while not done.wait(POLL_S):
            try:
                state = client.read_flow_run(flow_run_id).state
            except Exception:  # noqa: BLE001 - a busy or restarting server: ask again at the next poll
                continue
            if state is not None and (state.is_cancelling() or state.is_cancelled()):
                _state["reason"], _state["cancelled_run"] = CANCELLED, flow_run_id
                # a real signal to the main thread: it interrupts a blocking wait there (a lock, a future's result)
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                return


def mark_cancelled() -> None:
    """After a cancel, the flow run ends Cancelled, as the UI asked (Prefect's engine records an interrupted run as
    Crashed)."""
    flow_run_id = _state["cancelled_run"]
    if flow_run_id is None:
        return
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Cancelled(message="Cancelled; diffrl stopped the run"), force=True)
    except Exception as e:  # noqa: BLE001 - the run stopped; only its Prefect state is left as Crashed
        log.warning("could not mark flow run %s Cancelled: %s", flow_run_id, e)


def stop_engines(engines: EngineHandle) -> None:
    """Stop the run's engines after an interrupt without waiting for the step in flight (module docstring, 2)."""
    cfg = engines.config
    if cfg.cluster.mode == "ray":
        from diffrl.engines import cluster

        try:
            cluster.stop_actors(cfg.run.name)  # their GPUs are free for the next run at once
        except Exception as e:  # noqa: BLE001 - the interrupt is what to report
            log.error("diffrl: could not stop the run's Ray actors: %s (`diffrl cluster stop` removes them)", e)
        return
    memory = getattr(engines, "memory", None)
    if memory is not None and not memory.stop(WRITER_S):
        log.warning("the step's last writes did not land within %.0f s: the rerun makes them again", WRITER_S)


def where(step: int | None, stage: str | None) -> str:
    """`at step 3 (generate)`, `before training`: where the interrupted run was, for its one line."""
    from diffrl.engines.numbering import step_number

    if step is None:
        return "before training"
    return f"at step {step_number(step)}" + (f" ({stage})" if stage else "")


def end_command(code: int) -> None:
    """End the interrupted `diffrl` command now: its temporary Prefect server stops (Prefect would stop it at exit),
    then the process exits without joining the worker threads still inside a stage (a rollout or an update that would
    finish in seconds or minutes; its outputs were not committed and a resume makes them again)."""
    if "diffrl.flows.prefect_server" in sys.modules:
        from diffrl.flows.prefect_server import stop_servers

        stop_servers()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
