"""The hacking guard in the train flow (docs/training.md, "Hacking guard"): held-out probe prompts sampled every
`run.guard.probe_every` steps (and before training), and the bounds that stop a run whose statistics drift.

Each step's own image statistics (guard/brightness_mean, ...) come with its metrics from the reward stage
(diffrl/engines/step/generate.score). A bound compares a metric with its first value in the run, kept in
runs/<name>/guard.json so that a resumed run compares with the same one.
"""

from __future__ import annotations

from typing import Any

from diffrl.configs.guard import GuardConfig
from diffrl.configs.schema import ExperimentConfig
from diffrl.engines.handle import EngineHandle, Engines
from diffrl.engines.reward.image_stats import stat_metrics, stat_sums
from diffrl.engines.step.plan import validation_rollout
from diffrl.engines.store import fs
from diffrl.flows.build import load_prompts

PROBE_SEED_OFFSET = 20_000  # a generator's probe prompts differ from its training (seed) and validation (+10 000) ones


def probe_samples(engines: Engines, records: list, step: int):
    """Noise-free samples of the probe prompts, as the validation samples its prompts (runs where the rollout lives)."""
    return validation_rollout(engines.rollout, engines.config, records, step=step)


def probe_scores(engines: Engines, traj: Any) -> dict[str, float]:
    """guard/probe/reward (the mean over the samples the reward scored) and guard/probe/<statistic> of the probe
    samples (runs where the reward lives)."""
    out = engines.reward(traj.outputs, traj.prompts, traj.metadata)
    metrics = stat_metrics(stat_sums(traj.outputs), len(traj), prefix="guard/probe/")
    metrics["guard/probe/reward"] = float(out.scores[out.valid].mean()) if out.valid.any() else float("nan")
    return metrics


class Guard:
    """The run's probe prompts and the first value of each bounded metric (runs/<name>/guard.json)."""

    def __init__(self, cfg: ExperimentConfig):
        self.cfg: GuardConfig = cfg.run.guard
        self.records = []
        if self.cfg.probe_prompts is not None:  # a bad path fails here, before the model loads
            prompts = load_prompts(self.cfg.probe_prompts, cfg.data, seed=cfg.run.seed + PROBE_SEED_OFFSET)
            self.records = [prompts[i] for i in range(min(self.cfg.num_probe_prompts, len(prompts)))]
        self.path = fs.join(cfg.run_dir, "guard.json")
        self.first: dict[str, dict] = fs.read_json(self.path)["first"] if fs.exists(self.path) else {}

    def probes_before_training(self) -> bool:
        """Whether the probe before training is still to be sampled (a fresh run, or one that stopped before it)."""
        return bool(self.records) and not any(metric.startswith("guard/probe/") for metric in self.first)

    def probe(self, engines: EngineHandle, steps_done: int) -> dict[str, float]:
        """guard/probe/* after `steps_done` steps when a probe is due then; {} otherwise."""
        if not self.records or not self.cfg.probe_due(steps_done):
            return {}
        traj = engines.run("rollout", probe_samples, self.records, steps_done)
        return engines.run("reward", probe_scores, traj)

    def check(self, metrics: dict[str, float], steps_done: int) -> str | None:
        """The console line that stops the run when a bounded metric of `metrics` (logged at `steps_done`) is more than
        its max_drift from its first value; None otherwise. A metric's first value is recorded here."""
        recorded = False
        for bound in self.cfg.bounds:
            value = metrics.get(bound.metric)
            if value is None:
                continue
            first = self.first.get(bound.metric)
            if first is None:
                self.first[bound.metric] = {"value": float(value), "step": steps_done}
                recorded = True
                continue
            drift = abs(value - first["value"])
            if not drift <= bound.max_drift:  # NaN drift stops the run too: the statistic is broken
                when = "before training" if first["step"] == 0 else f"after step {first['step']}"
                return (
                    f"hacking guard: stopped after step {steps_done}: {bound.metric} {value:.4f} moved {drift:.4f} "
                    f"from {first['value']:.4f} ({when}), past its bound {bound.max_drift:g} (run.guard.bounds)"
                )
        if recorded:
            fs.write_json(self.path, {"first": self.first}, indent=2)
        return None
