"""How a failure of `diffrl` reaches its user: one line with the cause and the file it concerns, the advice to rerun the
same command only where a rerun can succeed, and the whole traceback in the run's log file (runs/<name>/diffrl.log).

    diffrl train: error: <cause naming its file>[; rerun the same command to resume] (traceback: runs/x/diffrl.log)
    diffrl: interrupted at step 3 (generate); rerun the same command to resume

`report(error)` sorts a failure by what caused it (the error and the errors that caused it, outermost first):
- interrupted (Ctrl-C, SIGTERM, a cancel of the flow run in the Prefect UI): exit 130; a rerun resumes.
- bad input (a config value, a YAML override, a path that does not exist): exit 2, no rerun advice.
- transient (out of memory, a reward server or network down, a killed worker or replica, a full disk): exit 1 and
  "rerun the same command to resume".
- deterministic (a damaged file of the run, non-finite weights, a read-only folder, a damaged mlflow.db, a checkpoint
  that does not fit the model): exit 1; the message says what to repair, and no rerun advice (the same run fails the
  same way).
- anything else (a stage failing in a way diffrl does not recognise): exit 1 with the rerun advice, as for a stage
  that failed once; the traceback in the log says more.

A message is flattened to one line, cut at MAX_LINE characters, unless its error declares `multiline = True`: a
refusal that lists what it refuses one item a line (diffrl/flows/run_config.py ConfigChangeRefused).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Iterator

from diffrl.configs.loader import ConfigError

RERUN = "rerun the same command to resume"
LOG_FILE = "diffrl.log"  # in the run's folder on the driver's disk (ExperimentConfig.local_dir)
MAX_LINE = 600  # characters of a cause on the console; the log has all of it

# Errors of libraries diffrl may not have imported, by class (module.qualname anywhere in the error's MRO): a rerun
# can succeed once the memory, the network or the worker is back.
TRANSIENT = {
    "torch.OutOfMemoryError": "out of memory",
    "httpx.TransportError": "network error",
    "ray.exceptions.RayActorError": "a Ray worker died",
    "ray.exceptions.WorkerCrashedError": "a Ray worker died",
    "ray.exceptions.NodeDiedError": "a Ray node died",
    "ray.exceptions.ObjectLostError": "a Ray object was lost",
    "diffrl.engines.cluster.ReplicaLost": "",
    "diffrl.engines.reward.base.RewardError": "",
}
# diffrl's own errors whose message says what to repair; the same run fails the same way until then
DETERMINISTIC = (
    "diffrl.engines.store.tables.DamagedStore",
    "diffrl.engines.train.checkpoint.NonFiniteWeights",
)
SIGNALS = ("prefect.exceptions.TerminationSignal",)  # Prefect's SIGTERM inside a flow run
# What frees GPU memory where a run ran out of it: by the stage it was in, else all of it
MEMORY_ADVICE = {
    "generate": "lower rollout.batch_size, or set model.offload_text_encoder: true",
    "update_actor": "lower train.micro_batch_size, or set train.gradient_checkpointing: true",
}
MEMORY_ADVICE_ANY = (
    "lower rollout.batch_size or train.micro_batch_size, or set train.gradient_checkpointing or "
    "model.offload_text_encoder: true"
)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class RunFailure(RuntimeError):
    """The run failed for a reason its message states fully (no traceback helps)."""

    rerun = False  # whether the same command, run again unchanged, can succeed


class DamagedRun(RunFailure):
    """A file of the run's stored data is missing or unreadable: rerunning cannot repair it."""


class Interrupted(KeyboardInterrupt):
    """`diffrl` was asked to stop; `how` says by what ("interrupted", "interrupted (SIGTERM)", "cancelled in the
    Prefect UI")."""

    def __init__(self, how: str = "interrupted"):
        super().__init__(how)
        self.how = how


@dataclass(frozen=True)
class Report:
    """What `diffrl` prints for a failure and how it exits. `known`: diffrl recognised the failure (else a command
    without a run log shows the traceback, as it always did)."""

    line: str
    code: int
    rerun: bool
    known: bool = True

    def text(self, command: str, log: str | None = None) -> str:
        """The one line: `diffrl <command>: error: <cause>; <advice> (traceback: <log>)`."""
        if self.code == 130:  # only a training run resumes
            return f"diffrl: {self.line}; {RERUN}" if command == "train" else f"diffrl {command}: {self.line}"
        advice = f"; {RERUN}" if self.rerun and "rerun the same command" not in self.line else ""
        where = f" (traceback: {log})" if log else ""
        return f"diffrl {command}: error: {self.line}{advice}{where}"


def chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, then what caused it, and so on (as a traceback shows them)."""
    seen = error
    while seen is not None:
        yield seen
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)


def cause(error: BaseException, kind: type) -> BaseException | None:
    """`error`, or the first error of type `kind` that caused it."""
    return next((seen for seen in chain(error) if isinstance(seen, kind)), None)


def _is_stop(error: BaseException) -> bool:
    """Whether `error` itself is a request to stop (Ctrl-C, SIGTERM, a cancel)."""
    return isinstance(error, KeyboardInterrupt) or bool(_classes(error) & set(SIGNALS))


def is_interrupt(error: BaseException) -> bool:
    """Whether `error` is a request to stop, not a failure: the request itself, or an error raised while a library
    handled it (Prefect's task engine, interrupted while it creates a task run, fails its own crash handling with
    "Task run is not set", the interrupt as that error's context)."""
    return any(_is_stop(seen) for seen in chain(error))


def report(error: BaseException) -> Report:
    """The line, exit code and rerun advice of `error` (see the module docstring); a stop request anywhere in the
    chain is what is reported (what failed after it failed because of it)."""
    stop = next((seen for seen in chain(error) if _is_stop(seen)), None)
    if stop is not None:
        return _known(stop, error)
    for seen in chain(error):
        known = _known(seen, error)
        if known is not None:
            return known
    return Report(one_line(_described(error)), 1, rerun=True, known=False)


def _known(seen: BaseException, error: BaseException) -> Report | None:
    if _is_stop(seen):
        how = getattr(seen, "how", "interrupted" if isinstance(seen, KeyboardInterrupt) else "interrupted (SIGTERM)")
        where = _tag(error, "diffrl_where")
        return Report(f"{how} {where}" if where else how, 130, rerun=True)
    if getattr(seen, "errno", None) in NO_SPACE or "No space left on device" in str(seen):  # whoever wrapped it
        full = one_line(_described(seen))
        return Report(f"{full} (the disk is full: free space, then rerun the same command to resume)", 1, rerun=True)
    if isinstance(seen, RunFailure):
        return Report(one_line(str(seen)), 1, rerun=seen.rerun)
    if isinstance(seen, (ConfigError, ValueError, FileNotFoundError)):  # bad input: the same input fails again
        return Report(str(seen) if getattr(seen, "multiline", False) else one_line(str(seen)), 2, rerun=False)
    classes = _classes(seen)
    if classes & set(DETERMINISTIC):
        return Report(one_line(str(seen)), 1, rerun=False)
    if isinstance(seen, OSError):
        return _os_error(seen)
    transient = next((what for name, what in TRANSIENT.items() if name in classes), None)
    if transient == "out of memory":  # where it ran out, and what frees memory there, before the long library text
        where = _tag(error, "diffrl_where")
        advice = MEMORY_ADVICE.get(_tag(error, "diffrl_stage"), MEMORY_ADVICE_ANY)
        return Report(one_line(f"out of memory{f' {where}' if where else ''} ({advice}): {_described(seen)}"), 1, True)
    if transient is not None:
        text = _described(seen) if transient == "" else f"{transient}: {_described(seen)}"
        return Report(one_line(text), 1, rerun=True)
    return None


def _tag(error: BaseException, name: str) -> str | None:
    """The first value of attribute `name` (diffrl_where, diffrl_stage: set by the train flow) along `error`'s chain."""
    return next((value for value in (getattr(seen, name, None) for seen in chain(error)) if value), None)


def _os_error(error: OSError) -> Report | None:
    """A folder diffrl may not write is no transient failure; a dropped connection or a timeout is."""
    if error.errno in NOT_WRITABLE:
        name = error.filename or "a file of the run"
        return Report(one_line(f"cannot write {name}: {error.strerror}"), 1, rerun=False)
    if isinstance(error, (ConnectionError, TimeoutError)):
        return Report(one_line(f"network error: {_described(error)}"), 1, rerun=True)
    return None


def _classes(error: BaseException) -> set[str]:
    # names, not imports: torch, ray and httpx need not be imported (or installed) for diffrl to name their errors
    return {f"{c.__module__}.{c.__qualname__}" for c in type(error).__mro__}


def _described(error: BaseException) -> str:
    """`Type: message` for a library's error (its type says more than its message alone); diffrl's own messages
    stand alone."""
    text = str(error) or type(error).__name__
    own = type(error).__module__.startswith("diffrl.")
    return text if own or text.startswith(type(error).__name__) else f"{type(error).__name__}: {text}"


def one_line(text: str) -> str:
    """`text` on one line of at most MAX_LINE characters (the log file keeps the whole message)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= MAX_LINE else flat[: MAX_LINE - 3] + "..."


def write_log(error: BaseException, folder: str) -> str:
    """Append `error`'s traceback (with the command line and the time) to `folder`/diffrl.log, credentials masked;
    returns its path. A folder that cannot be written (read-only, missing) gets a file in the temporary directory
    instead."""
    from diffrl.engines.redact import redact_text

    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    command = " ".join(["diffrl", *sys.argv[1:]])
    text = "".join(traceback.format_exception(error))
    entry = redact_text(f"==== {stamp} pid {os.getpid()}: {command}\n{text}\n")
    for path in (os.path.join(folder, LOG_FILE), os.path.join(tempfile.gettempdir(), f"diffrl-{os.getpid()}.log")):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a") as f:
                f.write(entry)
            return path
        except OSError:
            continue
    return ""


@contextlib.contextmanager
def logged_to(folder: str) -> Iterator[None]:
    """Write the traceback of an error leaving the block to `folder`'s log (write_log); the error carries the log's
    path (`diffrl_log`) for the one line that reports it."""
    try:
        yield
    except (Exception, KeyboardInterrupt) as e:
        e.diffrl_log = write_log(e, folder)
        raise


def log_of(error: BaseException) -> str | None:
    """The log file the traceback of `error` went to (logged_to), if any."""
    return next((s.diffrl_log for s in chain(error) if getattr(s, "diffrl_log", None)), None)
