"""run.guard: the hacking guard's config takes its bounds from YAML or a dotted override, and refuses bounds it
cannot check, naming the field and what it allows."""

from __future__ import annotations

import pytest

from diffrl.configs.guard import GuardBound
from diffrl.configs.loader import ConfigError
from diffrl.configs.schema import load_experiment

BOUND = "run.guard.bounds=[{metric: guard/brightness_mean, max_drift: 0.05}]"


def test_bounds_from_an_override_become_dataclasses_and_probes_fall_due_every_k_steps():
    cfg = load_experiment(None, [BOUND, "run.guard.probe_prompts=generator:ocr", "run.guard.probe_every=3"])
    assert cfg.run.guard.bounds == [GuardBound("guard/brightness_mean", 0.05)]
    assert [k for k in range(8) if cfg.run.guard.probe_due(k)] == [0, 3, 6]
    default = load_experiment(None).run.guard  # statistics on, no probes, no bounds
    assert default.image_stats and not default.bounds and not default.probe_due(0)


@pytest.mark.parametrize(
    "override, message",
    [
        ("run.guard.bounds=[{metric: brightness, max_drift: 0.1}]", r"bounds\[0\]: metric must be one of guard/"),
        ("run.guard.bounds=[{metric: guard/edge_density, max_drift: 0}]", "max_drift of guard/edge_density must"),
        ("run.guard.bounds=[{metric: guard/probe/reward, max_drift: 0.1}]", "guard/probe/reward needs probe_prompts"),
        ("run.guard.probe_every=0", "probe_every must be an integer >= 1"),
        ("run.guard.probe_prompts=''", "probe_prompts must be a prompt file"),
        (f"{BOUND[:-1]}, {BOUND.split('[', 1)[1]}", "one bound per metric, repeated: guard/brightness_mean"),
    ],
)
def test_bad_guard_settings_are_refused_with_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_experiment(None, [override])


def test_a_step_statistic_bound_needs_the_statistics():
    with pytest.raises(ConfigError, match="guard/brightness_mean needs image_stats: true"):
        load_experiment(None, [BOUND, "run.guard.image_stats=false"])
