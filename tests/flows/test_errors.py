"""How diffrl/flows/errors.py sorts failures into one line, an exit code and the rerun advice."""

from __future__ import annotations

import errno
import importlib

import pytest
import torch

from diffrl.configs.loader import ConfigError
from diffrl.engines.cluster import ReplicaLost
from diffrl.engines.reward.base import RewardError
from diffrl.engines.step.background import BackgroundError
from diffrl.engines.store.tables import DamagedStore
from diffrl.flows.errors import DETERMINISTIC, SIGNALS, TRANSIENT, DamagedRun, Interrupted, is_interrupt, report


def test_every_error_class_named_by_module_exists():
    """The library errors are named, not imported (errors.py needs none of them); a renamed class must fail here."""
    for name in [*TRANSIENT, *DETERMINISTIC, *SIGNALS]:
        module, _, cls = name.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), cls), type), name


def _wrapped(inner: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as e:
            raise outer from e
    except BaseException as e:
        return e


@pytest.mark.parametrize(
    "error, code, rerun, line",
    [
        (ConfigError("run.seed must be >= 0"), 2, False, "run.seed must be >= 0"),
        (DamagedRun("run 'x': rewards.lance is missing"), 1, False, "run 'x': rewards.lance is missing"),
        (DamagedStore("runs/x/checkpoints/latest.json is not ..."), 1, False, "runs/x/checkpoints/latest.json is not"),
        (
            _wrapped(OSError(errno.ENOSPC, "No space left on device", "runs/x/a.lance"), BackgroundError("writer")),
            1,
            True,
            "OSError: [Errno 28] No space left on device: 'runs/x/a.lance' (the disk is full: free space, then rerun",
        ),
        (PermissionError(errno.EROFS, "Read-only file system", "runs/x/run.lock"), 1, False, "cannot write runs/x/run"),
        (torch.OutOfMemoryError("CUDA out of memory"), 1, True, "out of memory (lower rollout.batch_size or train."),
        (_wrapped(ConnectionRefusedError(111, "refused"), RuntimeError("step")), 1, True, "network error: Connection"),
        (RewardError("http_scorer: http://h/score: failed after 3 attempts", "http_scorer"), 1, True, "http_scorer"),
        (ReplicaLost("replica r/engine-1 died ... rerun the same command: it resumes"), 1, True, "replica r/engine-1"),
        (RuntimeError("a stage failed in a way diffrl does not know"), 1, True, "RuntimeError: a stage failed"),
    ],
)
def test_a_failure_is_one_line_with_its_exit_code_and_rerun_advice(error, code, rerun, line):
    failure = report(error)
    assert (failure.code, failure.rerun) == (code, rerun) and failure.line.startswith(line), failure
    text = failure.text("train", "runs/x/diffrl.log" if code == 1 else None)
    assert "\n" not in text and text.count("rerun the same command") == int(rerun), text


def test_out_of_memory_says_where_and_what_frees_memory_there():
    error = _wrapped(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 320.00 MiB"), RuntimeError("step"))
    error.diffrl_where, error.diffrl_stage = "at step 2 (generate)", "generate"
    assert report(error).text("train") == (
        "diffrl train: error: out of memory at step 2 (generate) (lower rollout.batch_size, or set "
        "model.offload_text_encoder: true): OutOfMemoryError: CUDA out of memory. Tried to allocate 320.00 MiB; "
        "rerun the same command to resume"
    )


def test_an_interrupt_says_where_the_run_was():
    error = Interrupted("interrupted (SIGTERM)")
    error.diffrl_where = "at step 3 (generate)"
    assert report(error).text("train") == (
        "diffrl: interrupted (SIGTERM) at step 3 (generate); rerun the same command to resume"
    )
    assert report(KeyboardInterrupt()).code == 130
    assert report(KeyboardInterrupt()).text("ui") == "diffrl ui: interrupted"  # nothing to resume


def test_an_error_raised_while_an_interrupt_was_handled_reports_the_interrupt():
    """Prefect's task engine, interrupted by a cancel while it creates a task run, fails its crash handling with
    ValueError("Task run is not set") (the interrupt as its context): the command says it was cancelled, exit 130."""
    try:
        try:
            raise Interrupted("cancelled in the Prefect UI")
        except BaseException:  # as prefect.task_engine's initialize_run: handle_crash -> set_state raises
            raise ValueError("Task run is not set")  # noqa: B904 - the context is the point
    except ValueError as error:
        error.diffrl_where = "at step 2 (generate)"
        failure = report(error)
        assert is_interrupt(error)
    assert failure.code == 130 and failure.text("train") == (
        "diffrl: cancelled in the Prefect UI at step 2 (generate); rerun the same command to resume"
    )
    plain = ValueError("Task run is not set")  # the same error without an interrupt behind it is a failure
    assert not is_interrupt(plain) and report(plain).code == 2
