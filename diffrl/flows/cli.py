"""`diffrl`: the command line. Each command lives in diffrl/flows/commands/<name>.py with add_parser/run.

Exit codes: 0 success, 1 the work failed (traceback printed), 2 bad input (one-line error),
130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def _parser() -> tuple[argparse.ArgumentParser, dict]:
    from diffrl.flows.commands import cluster, export, random_model, sample, score, tiny_model, train

    parser = argparse.ArgumentParser(
        prog="diffrl",
        description="RL post-training for diffusion and flow-matching models (FlowGRPO, MixGRPO, GRPO-Guard, "
        "DanceGRPO, DPO, DiffusionNFT) as Prefect flows over Lance tables, tracked in MLflow.",
    )
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
    ):
        module.add_parser(sub)
        handlers[name] = module.run
    return parser, handlers


def main(argv: list[str] | None = None) -> int:
    # when the command started (a caller may set it earlier): `diffrl train` reports its startup from here
    os.environ.setdefault("DIFFRL_COMMAND_AT", str(time.time()))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Prefect logs every task state and HTTP call at INFO; keep the console to diffrl's own progress
    # lines unless the user asks for Prefect's (PREFECT_LOGGING_LEVEL=INFO).
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # transformers warns on import that torchvision is missing (CPU installs): not actionable here
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # the temporary Prefect server would try to send telemetry: this machine may have no network
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("diffrl").setLevel(logging.INFO)
    parser, handlers = _parser()
    args = parser.parse_args(argv)
    from diffrl.configs.loader import ConfigError

    handler = getattr(args, "run", None) or handlers[args.command]
    try:
        return int(handler(args) or 0)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        if os.environ.get("DIFFRL_DEBUG"):
            raise
        print(f"diffrl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
