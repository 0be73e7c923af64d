"""A user's `module:function` reward in a Ray actor (where an engine replica scores its chunks): the actor imports the
module from the driver's PYTHONPATH, which diffrl forwards to its actors before the node's own
(diffrl/engines/cluster.forwarded_env), as docs/rewards.md tells a user."""

from __future__ import annotations

import os

import numpy as np
import pytest

from diffrl.configs.reward import RewardConfig
from diffrl.engines.cluster import forwarded_env
from diffrl.engines.reward.multi import MultiReward


def test_a_ray_actor_scores_with_a_user_reward_from_the_drivers_pythonpath(ray_cluster, user_reward_modules):
    import ray

    env = forwarded_env()
    # the test cluster's workers were started without the folder: only the forwarded PYTHONPATH has it
    assert env["PYTHONPATH"].split(os.pathsep)[0] == user_reward_modules
    assert env["PYTHONPATH"].endswith("${PYTHONPATH}")  # the node's own path stays, after the driver's
    config = RewardConfig(components=[{"name": "my_rewards:brightness", "options": {"scale": 2.0}}])
    pool = ray.remote(MultiReward).options(runtime_env={"env_vars": env}, num_cpus=0).remote(config)
    try:
        images = np.random.default_rng(0).integers(0, 256, size=(4, 8, 8, 3), dtype=np.uint8)
        call = pool.score_component.remote("my_rewards:brightness", images, ["a"] * 4, [{}] * 4)
        out, down = ray.get(call, timeout=120)
    finally:
        ray.kill(pool)
    expected = 2.0 * images.reshape(4, -1).astype(np.float64).mean(1) / 255.0
    assert not down and out.scores.tolist() == pytest.approx(expected.tolist(), abs=1e-6)
