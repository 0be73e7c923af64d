"""`diffrl train [CONFIG] [overrides]`, `diffrl evaluate`, and `diffrl config show [--doc]|list`."""

from __future__ import annotations

import argparse
import sys
import time

import yaml

from diffrl.configs.loader import to_dict


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train an experiment (default: the offline quickstart)",
        description="Run an RL training experiment as a Prefect flow, one rl_step subflow per step. "
        "CONFIG is a shipped config name (see `diffrl config list`) or a YAML path; overrides "
        "are dotted keys (train.lr=1e-4 run.steps=20). Rerunning with the same run.name resumes.",
    )
    p.add_argument("config", nargs="?", default=None, help="config name or YAML path (default: quickstart)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.name=my-run train.lr=1e-4")
    p.set_defaults(run=run_train)

    e = subparsers.add_parser(
        "evaluate",
        help="score a checkpoint on the validation prompts (ODE sampling), logged to MLflow",
        description="Load a run's checkpoint (default: its latest), ODE-sample the validation prompts, score them "
        "with the run's reward and log val/* to an MLflow run named <run>-eval.",
    )
    e.add_argument("config", nargs="?", default=None, help="config name or YAML path (default: quickstart)")
    e.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.name=my-run")
    e.add_argument("--checkpoint", default=None, help="a checkpoints/step_<k> folder (default: the run's latest)")
    e.set_defaults(run=run_evaluate)

    c = subparsers.add_parser(
        "config",
        help="show or list experiment configs",
        description="`diffrl config show CONFIG [overrides]` prints the resolved config; "
        "`diffrl config list` lists the shipped configs.",
    )
    csub = c.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser(
        "show",
        help="print the fully resolved config as YAML (--doc: every key with its type, default and meaning)",
    )
    show.add_argument("config", nargs="?", default=None)
    show.add_argument("overrides", nargs="*")
    show.add_argument(
        "--doc",
        action="store_true",
        help="describe every key instead: type, default, allowed values and meaning (docs/configuration.md)",
    )
    show.set_defaults(run=run_show)
    lst = csub.add_parser("list", help="list the shipped configs")
    lst.set_defaults(run=run_list)


def split_config_args(args) -> tuple[str | None, list[str]]:
    # `diffrl train run.steps=3` (no CONFIG): the first positional is an override, not a config
    if args.config is not None and "=" in args.config:
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def run_show(args: argparse.Namespace) -> int:
    from diffrl.configs.schema import load_experiment

    config, overrides = split_config_args(args)
    if args.doc:
        if config is not None or overrides:
            raise ValueError("--doc describes the schema's keys and defaults: give no CONFIG or overrides with it")
        from diffrl.configs.doc import key_docs, render_markdown

        sys.stdout.write(render_markdown(key_docs()))
        return 0
    cfg = load_experiment(config, overrides)
    sys.stdout.write(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return 0


def run_list(args: argparse.Namespace) -> int:
    import os

    from diffrl.configs.schema import CONFIG_DIR

    names = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))
    width = max(map(len, names))
    for name in names:
        print(f"{name:<{width}}  {config_description(os.path.join(CONFIG_DIR, name + '.yaml'))}")
    return 0


def config_description(path: str) -> str:
    """A config file's first line, its one-line summary (`# ...`; every shipped config has one)."""
    with open(path) as f:
        first = f.readline()
    return first[1:].strip() if first.startswith("#") else ""


def run_evaluate(args: argparse.Namespace) -> int:
    from diffrl.configs.schema import load_experiment
    from diffrl.flows.evaluate import evaluate, resolve_checkpoint

    config, overrides = split_config_args(args)
    # bad input (config, no checkpoint) fails before Prefect or any model starts
    resolve_checkpoint(load_experiment(config, overrides), args.checkpoint)
    evaluate(config=config, overrides=overrides, checkpoint=args.checkpoint)
    return 0


def run_train(args: argparse.Namespace) -> int:
    from diffrl.configs.schema import check_logger_packages, load_experiment
    from diffrl.engines.store import fs
    from diffrl.flows.errors import logged_to
    from diffrl.flows.run_config import check_resume, hold_overrides
    from diffrl.flows.run_format import check_run_format
    from diffrl.flows.run_lock import run_lock

    config, overrides = split_config_args(args)
    cfg = load_experiment(config, overrides)  # fail on bad input before Prefect or any model starts
    check_logger_packages(cfg.run.loggers)  # so does a logger whose package is missing
    fs.use_options(cfg.run.root, cfg.run.storage_options)  # run.json on an object store is read below
    # a failure's traceback goes to runs/<name>/diffrl.log, the console gets one line (diffrl/flows/errors.py);
    # a second writer of the run is refused now, not after Prefect starts
    with logged_to(cfg.local_dir), run_lock(cfg.local_dir, cfg.run.name):
        check_run_format(cfg.run_dir, cfg.run.name)  # so is a run an older diffrl numbered
        check_resume(cfg)  # and a config change the run's stored data cannot take (diffrl/flows/run_config.py)
        server = _start_prefect_server()  # boots in its own process while this one imports torch, diffusers, MLflow
        from diffrl.flows.train import train

        prepared = prepare(cfg) if server is not None else {}  # it boots for seconds: load, validate
        if server is not None:
            server.join()
        train(
            config=config,
            overrides=hold_overrides(overrides),  # Prefect stores its parameters: no secrets
            command_started_at=args.started_at,
            flow_called_at=time.time(),  # the startup report's "imports" end here
            prepared_s=prepared,
        )
    return 0


def prepare(cfg) -> dict[str, float]:
    """What `diffrl train` prepares while Prefect's temporary server boots (7-14 s on the GPU machine; the flow cannot
    start before it is up): the run's engines, built and registered under the run name, where the train flow takes
    them for exactly this config (diffrl/flows/train.py take_prepared), and for a run without a checkpoint of its
    own its validation before training, which travels with the engines. MLflow's tracking store opens on a thread
    meanwhile (a new sqlite database migrates for about 2 s), so the flow's loggers find it ready.

    Only `cluster.mode: local` (Ray builds its engines in its actors), and only when preparing works: any error is
    left for the flow, which builds again and reports it in its own words. Returns the seconds each part took
    ("engines", "validation"; {} when nothing was prepared)."""
    from concurrent.futures import ThreadPoolExecutor

    from diffrl.engines import cluster
    from diffrl.engines.step.update import latest_checkpoint
    from diffrl.flows.build import build_engines
    from diffrl.flows.loggers import open_stores
    from diffrl.flows.train import validation_outputs

    if cfg.cluster.mode != "local":
        return {}
    parts: dict[str, float] = {}
    started = time.time()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(open_stores, cfg.run.loggers)  # an error opening it is left for the flow's own open
        try:
            engines = build_engines(cfg)
        except Exception:  # noqa: BLE001 - the flow builds again and reports this error in its own words
            cluster.drop(cfg.run.name)
            return {}
    parts["engines"] = time.time() - started
    # a resumed run, or one that starts from another's weights, validates after loading them
    fresh = latest_checkpoint(cfg.run_dir) is None and not cfg.run.init_from
    if fresh and cfg.data.num_val_prompts:
        started = time.time()
        try:
            engines.validation_before_training = validation_outputs(engines)
        except Exception:  # noqa: BLE001 - the flow validates again and reports
            return parts
        parts["validation"] = time.time() - started
    return parts


def _start_prefect_server():
    """Without PREFECT_API_URL the flow runs on Prefect's temporary local server, which takes seconds to boot in its
    own process. Start it now on a thread (the flow then finds it running) and return the thread to join; None
    when a server is configured. The server stops when this process ends, a kill -9 included
    (diffrl/flows/prefect_server.py)."""
    import os
    import threading

    if os.environ.get("PREFECT_API_URL"):
        return None

    def start() -> None:
        try:
            from diffrl.flows.prefect_server import server_class

            # the instance Prefect's client uses (one per port; None: its default), ending with this process
            server_class()().start()
        except Exception:  # noqa: BLE001 - the flow starts (and reports on) its own server as usual
            pass

    thread = threading.Thread(target=start, name="diffrl-prefect-server", daemon=True)
    thread.start()
    return thread
