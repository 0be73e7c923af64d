"""Nothing in a run folder is code: Prefect reads a persisted result with the serializer the file itself names, so
a stage result rewritten to say "pickle" would run its payload on resume. Only JSON is written there, and a result
file that is anything else is refused by name before its payload is touched."""

from __future__ import annotations

import base64
import json
import pickle

import pytest
from e2e_settings import TINY

from diffrl.flows.train import train
from diffrl.tasks.common import JsonResultStorage, UntrustedResult, check_result


class _Touch:
    """A pickle payload that creates a file when it is unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _record(storage_key: str, serializer: dict, result: str) -> bytes:
    metadata = {
        "storage_key": storage_key,
        "expiration": None,
        "serializer": serializer,
        "prefect_version": "3.8.8",
        "storage_block_id": None,
    }
    return json.dumps({"metadata": metadata, "result": result}).encode()


def _pickle_record(storage_key: str, marker: str) -> bytes:
    payload = base64.b64encode(pickle.dumps(_Touch(marker))).decode()
    return _record(storage_key, {"type": "pickle", "picklelib": "pickle", "picklelib_version": None}, payload)


def test_a_pickle_stage_result_is_refused_by_name_and_never_runs(workdir, monkeypatch):
    """Step 2 fails in its update: its generate, score and advantages results are persisted (and their rows,
    rewards and advantages landed), so a resume reads them back. One is rewritten as a pickle that would create
    a file: the resume refuses it, naming the file, and the file is never created. Without it the run goes on."""
    overrides = TINY + ["run.steps=2"]
    monkeypatch.setenv("DIFFRL_INJECT_FAULT", "update_actor@2")
    with pytest.raises(Exception, match="injected fault"):
        train(config=None, overrides=overrides)
    monkeypatch.delenv("DIFFRL_INJECT_FAULT")
    results = workdir / "runs" / "quickstart" / "prefect"
    [target] = results.glob("diffrl-quickstart-*-step1-advantages-0")
    marker = workdir / "payload-ran"
    target.write_bytes(_pickle_record(str(target), str(marker)))
    with pytest.raises(UntrustedResult, match=rf"refusing to read {target}: .*'pickle'"):
        train(config=None, overrides=overrides)
    assert not marker.exists()
    target.unlink()  # what the message says to do: the stage runs again
    assert train(config=None, overrides=overrides)["last_step"] == 2
    assert not marker.exists()
    stage_results = list(results.glob("diffrl-quickstart-*"))
    assert len(stage_results) == 2 * 7  # generate and score of 2 chunks, advantages, update_actor, sync_weights
    for path in stage_results:
        check_result(str(path), path.read_bytes())
    for path in set(results.iterdir()) - set(stage_results):  # Prefect's records of the failed task and step
        json.loads(path.read_bytes())  # JSON too, no pickle


@pytest.mark.parametrize(
    "serializer",
    [
        {"type": "pickle", "picklelib": "cloudpickle", "picklelib_version": None},
        # the JSON serializer with pickle as its "json library" or a decoder that imports and calls anything
        {"type": "json", "jsonlib": "pickle", "object_decoder": None, "dumps_kwargs": {}, "loads_kwargs": {}},
        {"type": "json", "jsonlib": "json", "object_decoder": "subprocess.call", "loads_kwargs": {}},
    ],
)
def test_the_result_storage_hands_prefect_only_plain_json(tmp_path, serializer):
    path = tmp_path / "diffrl-run-uid-step0-score-0"
    path.write_bytes(_record(str(path), serializer, "e30="))
    storage = JsonResultStorage(basepath=str(tmp_path))
    with pytest.raises(UntrustedResult, match=rf"refusing to read {path}"):
        storage.read_path(path.name)


def test_the_result_storage_refuses_objects_inside_a_json_result(tmp_path):
    """The JSON decoder Prefect uses rebuilds any importable class named under "__class__": refused too."""
    path = tmp_path / "result"
    serializer = {
        "type": "json",
        "jsonlib": "json",
        "object_encoder": "prefect.serializers.prefect_json_object_encoder",
        "object_decoder": "prefect.serializers.prefect_json_object_decoder",
        "dumps_kwargs": {},
        "loads_kwargs": {},
    }
    path.write_bytes(_record(str(path), serializer, json.dumps({"step": {"__class__": "os.system", "data": "x"}})))
    with pytest.raises(UntrustedResult, match="__class__"):
        JsonResultStorage(basepath=str(tmp_path)).read_path(path.name)
    path.write_bytes(_record(str(path), serializer, json.dumps({"step": 1, "rows": 4})))
    assert JsonResultStorage(basepath=str(tmp_path)).read_path(path.name) == path.read_bytes()
