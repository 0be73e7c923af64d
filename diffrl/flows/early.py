"""What `diffrl train` prepares while Prefect's temporary server boots: the engines, and the validation before training
of a run that has no checkpoint yet.

The temporary server boots in its own process (7-14 s on the GPU machine); the flow cannot start before it is up.
The command builds the run's engines (model load) and samples and scores the validation prompts in the meantime, and
the train flow then takes them instead of doing it again. MLflow's tracking store opens on a thread meanwhile (a new
sqlite database migrates for about 2 s), so the flow's Tracker finds it ready. Only `cluster.mode: local` (Ray
builds its engines in its actors); only for the config the flow will load (the same config and overrides, compared
as a whole); and only when preparing works: any error is left for the flow, which builds again and reports it as it
always did. A Prefect deployment run, which has no command around it, builds inside the flow as before.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from diffrl.configs.loader import to_dict
from diffrl.engines import cluster
from diffrl.flows.build import build_engines
from diffrl.flows.loggers import open_stores

_ENGINES: dict[str, tuple[dict, Any]] = {}  # run name -> (the config as a dict, its engines)
_VALIDATION: dict[str, Any] = {}  # run name -> what `validate_fn` returned for the engines before training


def prepare(cfg: Any, validate_fn: Callable[[Any], Any], *, fresh: bool) -> dict[str, float]:
    """Build the engines of `cfg` and, for a run without a checkpoint (`fresh`), its validation before training
    (`validate_fn(engines)`); returns the seconds each took ({} when nothing was prepared)."""
    if cfg.cluster.mode != "local":
        return {}
    parts: dict[str, float] = {}
    started = time.time()
    with ThreadPoolExecutor(max_workers=1) as pool:
        # an error opening it is left for the flow's own open, which reports it
        pool.submit(open_stores, cfg.run.loggers)
        try:
            engines = build_engines(cfg)
        except Exception:  # noqa: BLE001 - the flow builds again and reports this error in its own words
            cluster.drop(cfg.run.name)
            return {}
    _ENGINES[cfg.run.name] = (to_dict(cfg), engines)
    parts["engines"] = time.time() - started
    if fresh and cfg.data.num_val_prompts:
        started = time.time()
        try:
            _VALIDATION[cfg.run.name] = validate_fn(engines)
        except Exception:  # noqa: BLE001 - the flow validates again and reports
            return parts
        parts["validation"] = time.time() - started
    return parts


def take_engines(cfg: Any) -> Any | None:
    """The engines `prepare` built for exactly this config (registered again under the run name), else None."""
    early = _ENGINES.pop(cfg.run.name, None)
    if early is None:
        return None
    if early[0] != to_dict(cfg):
        early[1].memory.close()  # built for another config: its worker threads end, the flow builds its own
        return None
    cluster.put(cfg.run.name, early[1])
    return early[1]


def take_validation(run_name: str) -> Any | None:
    """The validation before training `prepare` made for this run, once; None if it made none."""
    return _VALIDATION.pop(run_name, None)
