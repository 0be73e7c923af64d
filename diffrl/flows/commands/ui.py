"""`diffrl ui [--port 5000] [--host 127.0.0.1] [--backend-store-uri URI]`: MLflow's UI on the runs of this folder.

    diffrl ui                  # http://127.0.0.1:5000, the working directory's mlflow.db (or MLFLOW_TRACKING_URI)

It is MLflow's own tracking server (`mlflow ui`), except that a browser's first visit opens experiments on their
training runs rather than MLflow's GenAI pages, and a run's image cards open on its newest step
(diffrl/flows/mlflow_ui.py). Stop it with Ctrl-C.
Exit codes: 0 stopped, 2 bad input (one-line error on stderr).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "ui",
        help="open MLflow's UI on this folder's runs (mlflow ui, opening experiments on their training runs)",
        description="Serve MLflow's tracking server and UI for the runs in mlflow.db (the tracking store `diffrl "
        "train` writes). A fresh browser opens each experiment on its training runs, not MLflow's GenAI pages.",
        epilog="example: diffrl ui --port 5000, then open http://127.0.0.1:5000",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=5000, help="port (default 5000)")
    parser.add_argument(
        "--backend-store-uri",
        default=None,
        help="tracking store (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory)",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from diffrl.flows.tracking import tracking_uri

    uri = args.backend_store_uri or tracking_uri()
    if uri.startswith("sqlite:///") and not os.path.isfile(uri.removeprefix("sqlite:///")):
        print(f"diffrl ui: error: {uri} does not exist: train a run here first (diffrl train)", file=sys.stderr)
        return EXIT_BAD_INPUT
    with socket.socket() as s:
        if s.connect_ex((args.host, args.port)) == 0:
            print(f"diffrl ui: error: {args.host}:{args.port} is in use: pass --port", file=sys.stderr)
            return EXIT_BAD_INPUT
    import uvicorn

    from diffrl.flows.mlflow_ui import configure_server, ui_app

    configure_server(uri, os.path.abspath("mlartifacts"))
    print(f"[diffrl] MLflow UI on http://{args.host}:{args.port} ({uri}); Ctrl-C stops it", flush=True)
    uvicorn.run(ui_app(), host=args.host, port=args.port, log_level="warning")
    return EXIT_OK
