"""`diffrl`: the command line. Each command lives in diffrl/flows/commands/<name>.py with add_parser/run.

Exit codes: 0 success, 1 the work failed, 2 bad input, 130 interrupted (Ctrl-C, SIGTERM, a cancel in the Prefect UI).
A failure is one line (diffrl/flows/errors.py); `diffrl train` writes its traceback to runs/<name>/diffrl.log. Another
command prints the traceback of a failure diffrl does not recognise, as Python does.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings


def _parser() -> tuple[argparse.ArgumentParser, dict]:
    from diffrl.flows.commands import (
        cluster,
        export,
        random_model,
        sample,
        score,
        serve_judge,
        tiny_model,
        train,
        ui,
    )

    parser = argparse.ArgumentParser(
        prog="diffrl",
        description="RL post-training for diffusion and flow-matching models (FlowGRPO, MixGRPO, GRPO-Guard, "
        "DanceGRPO, DPO, DiffusionNFT) as Prefect flows over Lance tables, tracked in MLflow.",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also show the libraries' own output (Prefect task states, MLflow, diffusers/transformers loading bars)",
    )
    parser.add_argument("--version", action="version", version=f"diffrl {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train.add_parser(sub)  # train and config set their own handlers
    handlers = {}
    for name, module in (
        ("sample", sample),
        ("score", score),
        ("tiny-model", tiny_model),
        ("random-model", random_model),
        ("cluster", cluster),
        ("export", export),
        ("serve-judge", serve_judge),
        ("ui", ui),
    ):
        module.add_parser(sub)
        handlers[name] = module.run
    return parser, handlers


def version() -> str:
    """The installed distribution's version; a source checkout on PYTHONPATH that is not installed reports the
    package's own `diffrl.__version__` (kept equal to pyproject.toml's by tests/flows/test_cli.py)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("diffrl")
    except PackageNotFoundError:
        import diffrl

        return diffrl.__version__


def main(argv: list[str] | None = None) -> int:
    started_at = time.time()  # `diffrl train` reports its startup from here
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the temporary Prefect server would try to send telemetry: this machine may have no network
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect gives its temporary server 20 s to answer; a loaded laptop (the model loading beside it) can take longer
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    parser, handlers = _parser()
    args = parser.parse_args(argv)
    args.started_at = started_at
    quiet_libraries(verbose=args.verbose)
    if not logging.getLogger().handlers:
        from diffrl.flows.console import one_traceback

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Prefixed())
        one_traceback(handler)  # -v: Prefect logs one failure at each level it passes through
        logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("diffrl").setLevel(logging.INFO)
    from diffrl.flows import interrupts
    from diffrl.flows.errors import log_of, report

    handler = getattr(args, "run", None) or handlers[args.command]
    command = argv is None  # the `diffrl` process itself, not a caller's main([...]) in its own process
    try:
        with interrupts.signals_raise(exit_on_second=command):
            return int(handler(args) or 0)
    except (Exception, KeyboardInterrupt) as e:
        failure, log = report(e), log_of(e)
        if os.environ.get("DIFFRL_DEBUG") or not (failure.known or log):
            raise
        print(failure.text(args.command, log if failure.code == 1 else None), file=sys.stderr, flush=True)
        if failure.code == 130:
            interrupts.mark_cancelled()
            if command:
                interrupts.end_command(130)
        return failure.code


class _Prefixed(logging.Formatter):
    """diffrl's log lines read like its progress lines ("[diffrl] ..."); other libraries' keep their own text, and
    Prefect's run loggers (-v) the task or flow run they are about, as Prefect's own format names it."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.name.split(".")[0] == "diffrl":
            return f"[diffrl] {text}"
        for attribute, kind in (("task_run_name", "Task run"), ("flow_run_name", "Flow run")):
            name = getattr(record, attribute, None)
            if name:  # "Finished in state Completed()" alone does not say which of a step's tasks finished
                return f"{kind} {name!r} - {text}"
        return text


def quiet_libraries(*, verbose: bool) -> None:
    """diffrl's own progress lines only, unless -v: Prefect's task states and HTTP calls, MLflow's database INFO
    lines, the loading bars of diffusers and transformers and peft's warning about a second adapter (DiffusionNFT's
    "old" adapter is one by design) stay out of the console. Settings the user exported win."""
    level = "INFO" if verbose else "WARNING"
    # Prefect's anonymous usage telemetry (and its first-run banner on a terminal) is off unless the user turns it
    # on (DO_NOT_TRACK=0): diffrl runs offline, where its reports could only time out (docs/operations.md)
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", level)
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", level)
    if not verbose:  # a failed flow or task logs its traceback; diffrl reports the error itself, as one line
        os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL", "CRITICAL")
        os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL", "CRITICAL")
    # transformers warns on import that torchvision is missing (CPU installs): not actionable here
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "info" if verbose else "error")
    if verbose:
        os.environ["DIFFRL_VERBOSE"] = "1"
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bars read it
    # Prefect's background senders say "Still processing items: N items remaining..." when a loaded machine has events
    # or logs queued at exit (on a logger named after the service class): after diffrl's own last line
    for service in ("EventsWorker", "APILogWorker"):
        logging.getLogger(service).setLevel(logging.ERROR)
    # a Ctrl-C while Prefect sets a task or flow run up makes its engine log "Crash detected! ..." on its own logger,
    # before the run's (CRITICAL above) takes over: diffrl reports the interrupt itself. A filter, not a level:
    # Prefect's logging setup (at import, again when its server starts) resets the levels of loggers under "prefect"
    engine = logging.getLogger("prefect.engine")
    if not any(isinstance(f, _CriticalOnly) for f in engine.filters):
        engine.addFilter(_CriticalOnly())
    from diffrl.flows.console import PEFT_SECOND_ADAPTER

    warnings.filterwarnings("ignore", message=PEFT_SECOND_ADAPTER)


class _CriticalOnly(logging.Filter):
    """Lets only CRITICAL records through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.CRITICAL


if __name__ == "__main__":
    sys.exit(main())
