"""The config a run records, what a resume may change in it, and a run that starts from another run's weights.

runs/<name>/config.yaml holds the config the run last started with (secrets as ***, as MLflow shows them). A rerun
compares its config with it before anything loads (diffrl/configs/changes.py): a field the run's stored data depends
on (FIXED_ON_RESUME next to each field) is refused with every such field's old and new value; any other change is
applied whole, said in one line and recorded in MLflow, whose params keep the values the run first started with: the
tag diffrl.config_changed_at_step and the artifact config/step_<k>.yaml, the config from step k on.

`run.init_from` (a run name under run.root, or a run folder) starts a run that has no checkpoint of its own from the
trained weights of that run's latest good checkpoint, with a fresh optimizer at step 0; the two configs' "weights"
fields (the model, the LoRA's shape) must agree.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from diffrl.configs.changes import Change, config_changes
from diffrl.configs.loader import to_dict
from diffrl.engines.handle import EngineHandle
from diffrl.engines.numbering import step_number
from diffrl.engines.redact import MASK, is_secret_name, redact, redact_text
from diffrl.engines.store import fs
from diffrl.flows.progress import console
from diffrl.flows.run_format import has_stored_data

CONFIG_FILE = "config.yaml"
# `diffrl train` checks a rerun's config before Prefect's server starts booting: what only a run that starts from
# another one's weights needs (torch.distributed's checkpoint modules, ~1 s) is imported where it is used


class ConfigChangeRefused(ValueError):
    """A rerun's config changes fields the run's stored data depends on."""

    multiline = True  # one line per changed field (diffrl/flows/errors.py keeps them)


def plain_config(cfg: Any) -> dict:
    """The config as it is recorded: plain YAML data, secrets replaced by *** (diffrl/engines/redact.py)."""
    return redact(to_dict(cfg))


def recorded_config(run_dir: str) -> dict | None:
    """The config run_dir/config.yaml records, or None for a run that has none (new, or from an older diffrl)."""
    path = fs.join(run_dir, CONFIG_FILE)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        recorded = yaml.safe_load(f)
    if not isinstance(recorded, dict):
        raise ValueError(f"{path} is not a config (a YAML mapping): restore it, or remove it to record this config")
    return recorded


def check_resume(cfg: Any) -> list[Change]:
    """Before anything loads: ConfigChangeRefused when the config changes a fixed field of a run that has stored data,
    ValueError when run.init_from cannot start this run; otherwise the changes against the recorded config, which
    the run applies and records (`record_config`)."""
    recorded = recorded_config(cfg.run_dir)
    changes = [] if recorded is None else config_changes(cfg, plain_config(cfg), recorded)
    fixed = [c for c in changes if c.fixed]
    if fixed and has_stored_data(cfg.run_dir):
        raise ConfigChangeRefused(_refusal(cfg, fixed))
    if cfg.run.init_from and not fs.exists(fs.join(cfg.run_dir, "checkpoints", "latest.json")):
        check_init_from(cfg)
    return changes


def _refusal(cfg: Any, fixed: list[Change]) -> str:
    lines = [
        f"run {cfg.run.name!r} ({cfg.run_dir}) holds stored data that these changed fields would contradict "
        f"(old -> new), so it cannot resume with them:",
        *(f"  {c}" for c in fixed),
    ]
    if any(c.kind == "weights" for c in fixed):  # the weights themselves differ: no run can start from them either
        lines.append("Rerun without these changes to resume it, or train a new run under another run.name")
    else:
        lines.append(
            "Rerun without these changes to resume it, or start a new run from its weights: "
            f"diffrl train CONFIG [overrides] run.name=NEW_NAME run.init_from={cfg.run.name}"
        )
    return "\n".join(lines)


def init_source(cfg: Any) -> str:
    """The run folder run.init_from names: a run name under run.root, or a path (it has a '/', or is a URI)."""
    value = cfg.run.init_from
    if "/" in value or "\\" in value or value in (".", ".."):
        return value.rstrip("/")
    return fs.join(cfg.run.root, value)


def check_init_from(cfg: Any) -> None:
    """ValueError (one line) when run.init_from names this run, a folder without a checkpoint, or a run whose
    recorded model or LoRA shape differs from this config's."""
    source = init_source(cfg)
    where = f"run.init_from={cfg.run.init_from!r}"
    if _same_folder(source, cfg.run_dir):
        raise ValueError(f"{where} names this run itself: rerun without run.init_from to resume it")
    if not fs.exists(fs.join(source, "checkpoints", "latest.json")):
        raise ValueError(
            f"{where}: {source} has no checkpoint (no checkpoints/latest.json): train that run first, or name another"
        )
    recorded = recorded_config(source)
    if recorded is None:  # a run from an older diffrl: its tensors' names and shapes are checked when they load
        return
    differ = [c for c in config_changes(cfg, plain_config(cfg), recorded) if c.kind == "weights"]
    if differ:
        raise ValueError(
            f"{where}: that run's weights do not fit this config ({'; '.join(map(str, differ))}): keep its model and "
            "LoRA shape, or train without run.init_from"
        )


def _same_folder(a: str, b: str) -> bool:
    if fs.is_uri(a) or fs.is_uri(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def good_checkpoint(run_dir: str) -> str:
    """The newest checkpoint of `run_dir` whose files match their checksums (ValueError naming the run when none
    does). The other run is only read: a damaged checkpoint is skipped, never moved."""
    from diffrl.engines.step.update import checkpoint_dir, latest_checkpoint, resume_candidates
    from diffrl.engines.train.checkpoint import CorruptCheckpoint, verify

    newest = latest_checkpoint(run_dir)
    if newest is None:
        raise ValueError(f"run.init_from: {run_dir} has no checkpoint (no checkpoints/latest.json)")
    problems = []
    for step in resume_candidates(run_dir, newest):
        path = checkpoint_dir(run_dir, step)
        try:
            verify(path)
        except CorruptCheckpoint as e:
            problems.append(str(e))
            continue
        return path
    raise ValueError(f"run.init_from: no checkpoint of {run_dir} is whole ({'; '.join(problems)})")


def init_from_run(engines: EngineHandle, tracker: Any) -> None:
    """Start a run without a checkpoint of its own from run.init_from's weights (every trainer rank), then bring the
    rollout to them; the optimizer, schedule and counters stay a new run's (step 0)."""
    from diffrl.engines.step.run import sync_engines
    from diffrl.engines.train.warm_start import load_initial_weights

    cfg = engines.config
    path = good_checkpoint(init_source(cfg))
    engines.run("trainer", load_initial_weights, path)
    sync_engines(engines, -1, prefetch_next=False)
    tracker.set_tags({"diffrl.init_from": path})
    _say(f"starting from the weights of {path} (run.init_from), with a new optimizer")


def record_config(cfg: Any, tracker: Any, changes: list[Change], start: int) -> None:
    """Write runs/<name>/config.yaml; a changed config is said in one line and recorded in MLflow at step
    `start` (the index of the first step it trains)."""
    plain, path = plain_config(cfg), fs.join(cfg.run_dir, CONFIG_FILE)
    if not fs.exists(path) and has_stored_data(cfg.run_dir):
        _say(f"run {cfg.run.name!r} recorded no config (an older diffrl started it): {path} records this one now")
    fs.write_text(path, yaml.safe_dump(plain, sort_keys=False))
    if not changes:
        return
    first = step_number(start)
    _say(f"config changed since the run last started, applied from step {first}: {', '.join(map(str, changes))}")
    tracker.log_config_change(plain, first, [str(c) for c in changes])


def _say(message: str) -> None:
    console.say(redact_text(message))


# recorded overrides -> the real ones, for the flow this process calls (its parameters are what Prefect stores)
_HELD: dict[tuple[str, ...], list[str]] = {}


def recorded_override(override: str) -> str:
    """`key=value` as it may be recorded: *** for a set value under a secret-like key (`...api_key=...`), for the
    secret-like keys of a YAML mapping value, and for a URL's credentials (redact)."""
    key, sep, value = override.partition("=")
    if not sep:
        return override
    if is_secret_name(key.rsplit(".", 1)[-1]) and value:
        return f"{key}={MASK}"
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:  # the loader reports it; nothing parsed to hide but URLs
        parsed = None
    if isinstance(parsed, (dict, list)) and redact(parsed) != parsed:
        return f"{key}={yaml.safe_dump(redact(parsed), default_flow_style=True, width=1 << 20).strip()}"
    return f"{key}={redact_text(value)}"


def hold_overrides(overrides: list[str]) -> list[str]:
    """The overrides to pass as the train flow's parameters, which Prefect stores in its database and shows in its
    UI: secret-like values are ***. The real ones stay in this process, where `held_overrides` gives them back to
    the flow."""
    recorded = [recorded_override(o) for o in overrides]
    if recorded != list(overrides):
        _HELD[tuple(recorded)] = list(overrides)
    return recorded


def held_overrides(overrides: list[str]) -> list[str]:
    """The real overrides `hold_overrides` kept for these recorded ones (the same list when nothing was hidden, or
    for a flow run a Prefect worker started from its stored parameters)."""
    return _HELD.get(tuple(overrides), list(overrides))
