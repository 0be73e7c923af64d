"""The run timeline (diffrl/engines/trace.py): spans from several threads into one Chrome trace-event file."""

from __future__ import annotations

import json
import threading
import time

from diffrl.engines import trace


def test_spans_of_two_threads_land_on_their_own_tracks_with_their_nesting(tmp_path):
    path = tmp_path / "trace" / "run.json"
    trace.enable(str(path))
    try:
        with trace.span("outer", step=2):
            time.sleep(0.01)
            with trace.span("inner"):
                time.sleep(0.01)
        worker = threading.Thread(target=_one_span, name="diffrl-test-worker")
        worker.start()
        worker.join()
    finally:
        trace.disable()
    events = trace.read(str(path))
    bars = {e["name"]: e for e in events if e["ph"] == "X"}
    assert set(bars) == {"outer", "inner", "worker span"}
    outer, inner, other = bars["outer"], bars["inner"], bars["worker span"]
    assert outer["args"] == {"step": 2} and outer["dur"] >= 20_000  # microseconds: two 10 ms sleeps inside
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert inner["tid"] == outer["tid"] != other["tid"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[other["tid"]] == "diffrl-test-worker"
    # Chrome's JSON array format without its closing bracket (the file is appended to as a run goes on)
    text = path.read_text()
    assert text.startswith("[\n") and json.loads(text.rstrip().rstrip(",") + "]")


def test_a_span_records_even_when_its_body_raises_and_nothing_is_written_when_off(tmp_path):
    with trace.span("not recorded"):  # off: no file anywhere
        pass
    path = tmp_path / "t.json"
    trace.enable(str(path))
    try:
        try:
            with trace.span("failed"):
                raise ValueError("boom")
        except ValueError:
            pass
    finally:
        trace.disable()
    trace.enable(str(path))  # a resumed run appends to the same file, which stays one valid array
    try:
        with trace.span("after resume"):
            pass
    finally:
        trace.disable()
    names = [e["name"] for e in trace.read(str(path)) if e["ph"] == "X"]
    assert names == ["failed", "after resume"]
    assert path.read_text().count("[") == 1
    assert list(tmp_path.iterdir()) == [path]


def _one_span() -> None:
    with trace.span("worker span"):
        time.sleep(0.001)
