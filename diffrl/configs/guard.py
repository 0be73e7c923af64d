"""The hacking guard's config (`run.guard`): image statistics of each step, held-out probe prompts every K steps, and
bounds on how far a statistic may drift before the run stops (docs/training.md, "Hacking guard")."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

STEP_METRICS = ("guard/brightness_mean", "guard/colourfulness_mean", "guard/edge_density")
PROBE_METRICS = (
    "guard/probe/reward",
    "guard/probe/brightness_mean",
    "guard/probe/colourfulness_mean",
    "guard/probe/edge_density",
)


@dataclass
class GuardBound:
    """Stop the run once `metric` is more than `max_drift` away from its first value in the run (a step statistic:
    the first step's; a probe's: the probe before training)."""

    metric: str
    max_drift: float

    def __post_init__(self) -> None:
        if self.metric not in STEP_METRICS + PROBE_METRICS:
            raise ValueError(f"metric must be one of {', '.join(STEP_METRICS + PROBE_METRICS)}; got {self.metric!r}")
        if isinstance(self.max_drift, bool) or not math.isfinite(self.max_drift) or self.max_drift <= 0:
            raise ValueError(f"max_drift of {self.metric} must be > 0 and finite, got {self.max_drift}")


@dataclass
class GuardConfig:
    """guard/* metrics of every step (image_stats), of the probe prompts every probe_every steps, and the bounds
    that stop a run whose statistics drift (none by default)."""

    # guard/brightness_mean, guard/colourfulness_mean, guard/edge_density of each step's images
    image_stats: bool = True
    # held-out prompts (parquet / jsonl / txt path, or generator:<name>) sampled without noise every probe_every steps
    # and before training; their reward and image statistics are logged as guard/probe/*. None: no probes
    probe_prompts: str | None = None
    num_probe_prompts: int = 8  # the first k of probe_prompts
    probe_every: int = 10  # probe after every k-th step (and before the first)
    # [{metric: guard/brightness_mean, max_drift: 0.1}, ...]: the run stops after the step where a metric moved more
    # than max_drift from its first value. [] never stops
    bounds: list[GuardBound] = field(default_factory=list)

    def __post_init__(self) -> None:
        # YAML gives dicts; turn them into bounds here so only dataclasses travel further
        self.bounds = [b if isinstance(b, GuardBound) else GuardBound(**b) for b in self.bounds]
        if self.probe_prompts == "":
            raise ValueError("probe_prompts must be a prompt file, a generator:<name> or null; got ''")
        if isinstance(self.probe_every, bool) or not isinstance(self.probe_every, int) or self.probe_every < 1:
            raise ValueError(f"probe_every must be an integer >= 1, got {self.probe_every!r}")
        if self.num_probe_prompts < 1:
            raise ValueError(f"num_probe_prompts must be >= 1, got {self.num_probe_prompts}")
        metrics = [b.metric for b in self.bounds]
        repeated = sorted({m for m in metrics if metrics.count(m) > 1})
        if repeated:
            raise ValueError(f"bounds: one bound per metric, repeated: {', '.join(repeated)}")
        for metric in metrics:
            if metric in PROBE_METRICS and self.probe_prompts is None:
                raise ValueError(f"bounds: {metric} needs probe_prompts (the prompts to probe)")
            if metric in STEP_METRICS and not self.image_stats:
                raise ValueError(f"bounds: {metric} needs image_stats: true")

    def probe_due(self, steps_done: int) -> bool:
        """Whether the probes are sampled after `steps_done` RL steps (0: before training)."""
        return self.probe_prompts is not None and steps_done % self.probe_every == 0
