"""What every stage task shares: its cache key is (run incarnation, step, stage, chunk), so a retried or
resumed flow run finds a completed stage Cached instead of running it again, and results are small
JSON records persisted with the run (read back only through JsonResultStorage). Tasks run in the flow's process (on
Prefect's thread pool): a stage task is a thin call into the engines, here or in their Ray actors."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.filesystems import LocalFileSystem
from prefect.serializers import JSONSerializer

from diffrl.engines import cluster


def stage_key(run_name: str, uid: str, step: int, stage: str, chunk: int = 0) -> str:
    """The cache key (and persisted result file name) of one stage of one step."""
    return f"{run_key_prefix(run_name, uid)}{step}-{stage}-{chunk}"


def run_key_prefix(run_name: str, uid: str) -> str:
    """What every stage key of a run incarnation starts with (the step number follows)."""
    return f"diffrl-{run_name}-{uid}-step"


def stage_cache_key(stage: str) -> Callable[[Any, dict], str]:
    """Prefect cache_key_fn for a stage: same run, step and chunk -> the same key."""

    def key(_context: Any, params: dict) -> str:
        run_name = params["run_name"]
        uid = cluster.get(run_name).run_uid
        return stage_key(run_name, uid, params["step"], stage, params.get("chunk", 0))

    return key


# Keyword arguments every stage task shares (persisted JSON results -> Cached on retry/resume).
STAGE = dict(persist_result=True, result_serializer="json", retries=0)

# The one serializer a result file in a run folder may name: Prefect's JSON serializer with its defaults. Prefect
# deserializes a result with whatever serializer the file names, so a file that says "pickle" (or "json" with
# jsonlib "pickle", or a decoder such as "subprocess.call") would run code as the user who resumes the run.
_JSON = JSONSerializer().model_dump(mode="json")
# Keys under which Prefect's JSON decoder imports a class (or exception) by name and builds it.
_OBJECT_KEYS = ("__class__", "__exc_type__")


class UntrustedResult(ValueError):
    """A result file in a run folder that diffrl did not write: not plain JSON data."""


def check_result(path: str, content: bytes) -> bytes:
    """`content` of the result file `path` if it is a Prefect result record of plain JSON data written by the
    JSON serializer; else UntrustedResult naming the file. Nothing in it is deserialized beyond json.loads."""

    def refuse(why: str) -> UntrustedResult:
        return UntrustedResult(
            f"refusing to read {path}: {why}. diffrl reads back only the JSON stage results it writes; this file was "
            "put there by someone or something else (a copied run, a shared disk): check it, then delete it to run "
            "that stage again"
        )

    try:
        record = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        raise refuse("it is not JSON (a pickle, or another serializer's bytes)") from None
    if not isinstance(record, dict) or set(record) != {"metadata", "result"} or not isinstance(record["result"], str):
        raise refuse("it is not a Prefect result record {metadata, result}")
    serializer = record["metadata"].get("serializer") if isinstance(record["metadata"], dict) else None
    if serializer != _JSON:
        kind = serializer.get("type") if isinstance(serializer, dict) else serializer
        raise refuse(f"its serializer is {kind!r} with settings {json.dumps(serializer)}, not plain JSON")
    found: list[str] = []

    def objects(mapping: dict) -> dict:
        found.extend(key for key in _OBJECT_KEYS if key in mapping)
        return mapping

    try:
        json.loads(record["result"], object_hook=objects)
    except ValueError:
        raise refuse("its result is not JSON") from None
    if found:
        raise refuse(f"its result names objects to build ({', '.join(sorted(set(found)))})")
    return content


class JsonResultStorage(LocalFileSystem):
    """A run's stage results on the local disk (runs/<name>/prefect): what Prefect reads from it (before any
    deserializing, for a cache lookup too) must pass `check_result`."""

    _block_type_name = "diffrl JSON results"

    async def aread_path(self, path: str) -> bytes:
        return self.read_path(path, _sync=True)

    @async_dispatch(aread_path)
    def read_path(self, path: str) -> bytes:
        resolved = self._resolve_path(path)
        if not resolved.is_file():
            raise ValueError(f"Path {resolved} does not exist.")  # Prefect's own wording: "no cached result"
        with open(resolved, "rb") as f:
            return check_result(str(resolved), f.read())


def persist_results_in(step_flow: Any, results_dir: str) -> Any:
    """`step_flow` with its tasks' results persisted in `results_dir` through JsonResultStorage. Prefect's Flow()
    takes an unsaved storage block only as a Path, which it turns into a plain (unsaved) LocalFileSystem when the
    flow runs: the same thing, so the JsonResultStorage is set on the flow after it is made."""
    step_flow.result_storage = JsonResultStorage(basepath=results_dir)
    return step_flow


def check_results(results_dir: str, names: list[str]) -> None:
    """UntrustedResult for the first of the result files `names` in `results_dir` that exists and is not plain
    JSON data (Prefect's cache lookup would skip it silently; the run stops and says which)."""
    for name in names:
        path = os.path.join(results_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                check_result(path, f.read())
