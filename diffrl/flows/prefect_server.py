"""Prefect's temporary server, bound to the process that starts it.

Without PREFECT_API_URL a flow runs on a temporary Prefect server that Prefect starts as a subprocess and stops at
interpreter exit (atexit). A `diffrl train` killed with SIGKILL runs no atexit, so its server would go on listening.
Here the server process watches its parent: when the parent is gone (the server is re-parented),
it stops itself (SIGTERM to its own uvicorn, then a hard exit). A watcher in the child, not PR_SET_PDEATHSIG: that
signal fires when the *thread* that started the child ends, and diffrl starts the server from a short-lived thread.
The server runs in a session of its own, so a terminal's Ctrl-C reaches `diffrl` only, which stops the server once it
has recorded the interruption there (diffrl/flows/interrupts.py).

    python -m diffrl.flows.prefect_server PARENT_PID UVICORN_ARGS...   (what ParentBoundServer runs)

The server's app is Prefect's own, behind `RetryWhenBusy`: on its SQLite database Prefect answers 503 when a
write finds the database locked by another writer (its task-run recorder, writing the states of the previous step's
tasks), and Prefect's client then waits 2 s (2**1, its fixed first back-off) before trying again, which delays most
step subflows of a fast recipe (2.0-2.6 s instead of 0.15 s on an H200). The server retries such a request itself
after a few milliseconds: the same request the client would resend.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Awaitable, Callable

Message = dict[str, Any]
ASGIApp = Callable[[dict, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]
# waits (s) between the server's own tries of a request answered 503 (1.6 s in all; then the client's back-off)
BUSY_RETRY_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.5, 0.5)

POLL_S = 0.25  # how often the server checks its parent
STOP_S = 5.0  # how long a graceful stop may take before the server exits hard


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's handler: a graceful shutdown
    time.sleep(STOP_S)
    os._exit(0)


def main(argv: list[str]) -> None:
    parent = int(argv[0])
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the watcher started
        os._exit(0)
    from uvicorn.main import main as uvicorn

    uvicorn(args=argv[1:], prog_name="uvicorn")  # exits with uvicorn's code (3: the port is taken)


class RetryWhenBusy:
    """ASGI middleware: an HTTP request the app answers with 503 (Service Unavailable: Prefect's answer to a locked
    database, which its client retries after 2 s) is run again here after BUSY_RETRY_S waits; the first other answer,
    or the last 503, goes to the client. The request body is kept to replay it (Prefect's API bodies are small JSON);
    any other answer streams through untouched, and websockets pass by."""

    def __init__(self, app: ASGIApp, waits: tuple[float, ...] = BUSY_RETRY_S):
        self.app, self.waits = app, waits

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            body, more = body + message.get("body", b""), message.get("more_body", False)
        for wait in (*self.waits, None):
            if not await self._try(scope, body, receive, send, last=wait is None):
                return
            await asyncio.sleep(wait)

    async def _try(self, scope: dict, body: bytes, receive: Callable, send: Callable, *, last: bool) -> bool:
        """Run the request once; True when it was answered 503 (and nothing was sent) and may be tried again."""
        replayed = False
        busy = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, when it comes

        async def answer(message: Message) -> None:
            nonlocal busy
            if message["type"] == "http.response.start" and message["status"] == 503 and not last:
                busy = True
            if not busy:
                await send(message)

        # a fresh copy of the request's scope: the app's routing writes into the one it gets (FastAPI keeps the
        # request's closed exit stacks there, and a second run on the same dict failed with 500)
        try:
            await self.app(dict(scope), replay, answer)
        except Exception:
            # Starlette's outermost middleware raises the error again after its handler answered (503 here): a
            # swallowed answer's error is this middleware's to drop; any other goes on to uvicorn as before
            if not busy:
                raise
        return busy


def create_app() -> ASGIApp:
    """uvicorn's factory: Prefect's server app behind RetryWhenBusy."""
    from prefect.server.api.server import create_app as prefect_app

    return RetryWhenBusy(prefect_app())


@functools.cache
def server_class() -> type:
    """A SubprocessASGIServer whose server process ends with this one (created first, it is the instance Prefect's
    client uses: SubprocessASGIServer() returns one instance per port)."""
    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class ParentBoundServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            return subprocess.Popen(
                args=[
                    sys.executable,
                    "-m",
                    "diffrl.flows.prefect_server",
                    str(os.getpid()),
                    "--app-dir",
                    str(prefect.__module_path__.parent),
                    "--factory",
                    "diffrl.flows.prefect_server:create_app",  # Prefect's app, retrying on a busy database
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "error",
                    "--lifespan",
                    "on",
                ],
                env={
                    **os.environ,
                    **server_environment(),
                    **get_current_settings().to_environment_variables(exclude_unset=True),
                },
                # out of the terminal's process group: Ctrl-C interrupts `diffrl`, which then records the interruption
                # on this server and stops it (diffrl/flows/interrupts.py); a server stopped by the same Ctrl-C would
                # leave Prefect's client retrying it for about 70 s
                start_new_session=True,
            )

    return ParentBoundServer


def stop_servers() -> None:
    """Stop the temporary Prefect servers this process started, now (Prefect stops them at interpreter exit, which
    an interrupted `diffrl train` skips: diffrl/flows/interrupts.end_command)."""
    from prefect.server.api.server import SubprocessASGIServer

    for server in list(SubprocessASGIServer._instances.values()):  # Prefect's registry of them, one per port
        server.stop()


def server_environment() -> dict[str, str]:
    """The variables diffrl's temporary server process gets on top of this process's environment (Prefect's settings
    the user set still come after them)."""
    # Prefect 3.8.8's own for its temporary server
    env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    # no block types registered at boot (2.6 s of a first boot on the GPU machine): diffrl saves no blocks,
    # its result storage is an unsaved one; `prefect server start` registers them when a user starts one
    env["PREFECT_API_BLOCKS_REGISTER_ON_START"] = "false"
    # the server's telemetry service reports to Prefect every few minutes and logs "Failed to send telemetry" where
    # there is no network (diffrl runs offline); a value the user exported wins
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = os.environ.get("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # no event feed stored: every task run's three state changes are events, ~75 KB of rows and indexes a step on
    # SQLite, which only Prefect's event pages read (task and flow runs and their states are recorded from the event
    # stream by another service, and stay); a value the user exported wins
    key = "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED"
    env[key] = os.environ.get(key, "false")
    return env


if __name__ == "__main__":
    main(sys.argv[1:])
