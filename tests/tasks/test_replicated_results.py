"""The persisted results of a stage every engine replica runs at once (advantages, update_actor, sync_weights) are
kept all or none: a replica that died after the others recorded the stage would otherwise find the stage Cached on
some replicas and run it on the others, and the replicas would part ways (a weight sync bumping one policy version
only, then updates with other passes on each: a collective that never completes)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

from prefect.serializers import JSONSerializer

from diffrl.configs.schema import load_experiment
from diffrl.tasks.common import stage_key
from diffrl.tasks.stages import check_step_results


def _result(folder, name: str) -> str:
    """A stage result file as Prefect's JSON serializer writes it (plain data: check_step_results reads it)."""
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        meta = {"storage_key": path, "expiration": None, "serializer": JSONSerializer().model_dump(mode="json")}
        json.dump({"metadata": meta, "result": json.dumps({"step": 1})}, f)
    return path


def test_a_stage_recorded_by_some_replicas_only_runs_again_on_all(tmp_path):
    cfg = load_experiment(None, ["cluster.mode=ray", "cluster.gpus=2", "algorithm=flow_grpo", "rollout.chunk_size=24"])
    engines = SimpleNamespace(config=cfg, run_uid="u1")  # what the check reads of a run's engines: config and uid
    key = lambda stage, replica: stage_key(cfg.run.name, "u1", 1, stage, replica)  # noqa: E731
    whole = [_result(tmp_path, key("update_actor", r)) for r in (0, 1)]  # both replicas recorded their update
    partial = _result(tmp_path, key("sync_weights", 0))  # replica 1 died in its weight sync
    other_step = _result(tmp_path, stage_key(cfg.run.name, "u1", 2, "sync_weights", 0))
    check_step_results(engines, 1, str(tmp_path))
    assert all(os.path.exists(p) for p in whole) and os.path.exists(other_step)
    assert not os.path.exists(partial)


def test_one_replica_keeps_its_results(tmp_path):
    cfg = load_experiment(None, [])
    engines = SimpleNamespace(config=cfg, run_uid="u1")
    kept = _result(tmp_path, stage_key(cfg.run.name, "u1", 1, "sync_weights", 0))
    check_step_results(engines, 1, str(tmp_path))
    assert os.path.exists(kept)
