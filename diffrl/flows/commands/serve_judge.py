"""`diffrl serve-judge`: a vLLM OpenAI-compatible judge server for the `vlm_judge` reward, e.g.

    diffrl serve-judge /models/Qwen2.5-VL-7B-Instruct --port 8000            # serves until Ctrl-C / SIGTERM
    diffrl serve-judge ./judge --port 8000 --with "diffrl train my.yaml"     # serves while the command runs

It creates (first time, a few minutes) or reuses the vLLM virtualenv (diffrl/engines/vllm_env.py), starts the server
on 127.0.0.1 with a start timeout and a health check, prints the reward options that point at it, then either waits
(until interrupted, or until the server dies: exit 1 with its log's tail) or runs COMMAND and stops the server when
COMMAND ends (exit code: COMMAND's). `--prepare` only creates the venv and prints its interpreter.
Exit codes: 0 ok, 1 the server failed to start or died, 2 bad input, else COMMAND's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers the `serve-judge` subcommand."""
    parser = subparsers.add_parser(
        "serve-judge",
        help="serve a local judge model with vLLM for the vlm_judge reward",
        description=(
            "Start an OpenAI-compatible vLLM server for a local judge model folder (from diffrl's cached vLLM "
            "virtualenv, created on first use), on loopback, and keep it up until interrupted or until the --with "
            "COMMAND ends."
        ),
        epilog='example: diffrl serve-judge ./judge --port 8000 --with "diffrl train my.yaml"',
    )
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL_DIR",
        help="a local Hugging Face model folder, or reference:<name> / tiny:<arch> (e.g. reference:shapes-thinker)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--served-model-name", default="judge", help="the reward's `model` option (default judge)")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16, float32 (default auto)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="context length (default 4096)")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for /health (600)")
    parser.add_argument("--log", default=None, help="the server's log file (default: a file in the temp folder)")
    parser.add_argument("--vllm-arg", action="append", default=[], help="one more vLLM flag, verbatim; repeatable")
    parser.add_argument("--prepare", action="store_true", help="only create the vLLM venv and print its python")
    parser.add_argument(
        "--with",
        dest="wrapped",
        default=None,
        metavar="COMMAND",
        help="run COMMAND (one string) while the server is up",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from diffrl.configs.vllm import VllmServerOptions
    from diffrl.engines.vllm_env import vllm_python
    from diffrl.engines.vllm_server import VllmServer, VllmServerError

    if not args.prepare:  # bad input is reported before the vLLM venv is made (minutes, the first time)
        if args.model and args.model.startswith(("reference:", "tiny:")):
            from diffrl.flows.commands.sample import model_folder

            try:
                args.model = model_folder(args.model)
            except ValueError as e:
                print(f"diffrl serve-judge: error: {e}", file=sys.stderr)
                return 2
        if not args.model or not os.path.isfile(os.path.join(args.model, "config.json")):
            print(f"diffrl serve-judge: error: {args.model!r} is not a model folder (no config.json)", file=sys.stderr)
            return 2
    python = vllm_python()
    if args.prepare:
        print(python)
        return 0
    command = shlex.split(args.wrapped) if args.wrapped else []
    options = VllmServerOptions(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=max(2048, args.max_model_len),
        start_timeout_s=args.start_timeout,
        extra_args=tuple(args.vllm_arg),
    )
    server = VllmServer(args.model, options, python=python, log_path=args.log)
    # SIGTERM (a test, a scheduler) stops the server like Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        server.start()
        reward = {"base_url": server.base_url, "model": server.name}
        pid = server.process.pid
        print(
            f"judge ready on {server.base_url} (pid {pid}) after {server.started_s:.1f} s; vlm_judge options: "
            f"{json.dumps(reward)}"
        )
        sys.stdout.flush()
        return _serve(server, command)
    except VllmServerError as e:
        print(f"diffrl serve-judge: error: {e}", file=sys.stderr)
        return 1
    finally:
        server.stop()


def _serve(server, command: list[str]) -> int:
    """Wait until interrupted (or the server dies), or run `command` and return its exit code."""
    child = subprocess.Popen(command) if command else None
    try:
        while True:
            server.check_alive()  # raises VllmServerError when it died: the caller reports it, exit 1
            if child is not None and child.poll() is not None:
                return child.returncode
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0 if child is None else _stop_child(child)
    except BaseException:
        if child is not None:
            _stop_child(child)
        raise


def _stop_child(child: subprocess.Popen) -> int:
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return child.returncode
