"""How a config differs from a run's recorded one, and which differences a resume refuses
(diffrl/configs/changes.py)."""

from __future__ import annotations

from diffrl.configs.changes import config_changes
from diffrl.configs.loader import to_dict
from diffrl.configs.schema import load_experiment


def _changes(before: list[str], after: list[str]) -> dict[str, tuple[str, str | None]]:
    recorded = to_dict(load_experiment(None, before))
    cfg = load_experiment(None, after)
    return {c.key: (str(c), c.kind) for c in config_changes(cfg, to_dict(cfg), recorded)}


def test_the_optimizer_and_cadence_may_change_the_sampler_and_the_lora_shape_may_not():
    before = ["train.lr=3.0e-3", "run.steps=3", "rollout.group_size=4", "train.lora_rank=16"]
    after = ["train.lr=1.0e-2", "run.steps=4", "rollout.group_size=2", "train.lora_rank=8"]
    before, after = before + ["algorithm.noise_level=0.7"], after + ["algorithm.noise_level=0.5"]
    assert _changes(before, after) == {
        "run.steps": ("run.steps: 3 -> 4", None),
        "algorithm.noise_level": ("algorithm.noise_level: 0.7 -> 0.5", "data"),
        "rollout.group_size": ("rollout.group_size: 4 -> 2", "data"),
        "train.lora_rank": ("train.lora_rank: 16 -> 8", "weights"),
        "train.lr": ("train.lr: 0.003 -> 0.01", None),
    }


def test_another_algorithm_or_reward_is_one_change():
    two_rewards = "reward.components=[{name: jpeg_compressibility}, {name: aesthetic}]"
    changes = _changes([], ["algorithm=flow_grpo", two_rewards])
    assert set(changes) == {"algorithm.name", "reward.components"}
    assert changes["algorithm.name"][1] == "data" and changes["reward.components"][1] == "data"


def test_a_field_the_recorded_config_lacks_is_not_compared():
    recorded = to_dict(load_experiment(None, []))
    del recorded["train"]["lr"]  # a diffrl before the field
    cfg = load_experiment(None, ["train.lr=1.0e-2"])
    assert config_changes(cfg, to_dict(cfg), recorded) == []


def test_every_fixed_field_is_a_field_of_its_class():
    """A renamed field would leave its FIXED_ON_RESUME entry naming nothing, and the field free to change."""
    import dataclasses

    from diffrl.algorithms.catalog import algorithms
    from diffrl.configs import schema
    from diffrl.configs.reward import RewardComponent
    from diffrl.configs.train import TrainConfig

    classes = [schema.ModelConfig, schema.RolloutConfig, schema.DataConfig, schema.RunConfig, TrainConfig]
    classes += [RewardComponent, *{type(a) for a in algorithms().values()}]
    for cls in classes:
        assert set(cls.FIXED_ON_RESUME) <= {f.name for f in dataclasses.fields(cls)}, cls
        assert set(cls.FIXED_ON_RESUME.values()) <= {"data", "weights"}, cls
