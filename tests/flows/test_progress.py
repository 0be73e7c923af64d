"""`diffrl train`'s step line (diffrl/flows/progress.py): live on a terminal, one plain line per step elsewhere."""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm

from diffrl.flows.progress import Console


class _Terminal(io.StringIO):
    """What a terminal is to the console: a stream that says it is a TTY."""

    def isatty(self) -> bool:
        return True


def _steps(console: Console) -> None:
    console.say("before training: val/reward 0.4222")
    console.step(1, 3, "reward 0.4583, 16.08 images/s (2.98 s), eta 0m06s")
    console.step(2, 3, "reward 0.3854, 18.27 images/s (2.63 s), eta 0m03s")
    console.say("a note between steps")
    console.step(3, 3, "reward 0.5590, 11.96 images/s (4.01 s)", note="val/reward 0.5245")
    console.close()
    console.say("done.")


@pytest.mark.parametrize("other_bar", [False, True])
def test_a_terminal_gets_one_live_line_rewritten_in_place(other_bar, monkeypatch):
    """Each step rewrites the same line ('\\r', no newline) with a bar, the reward, images/s and the time left; the
    run's other lines (and a step's validation results) are printed above it, whole. Also while another tqdm bar of
    the process is alive (not closed, or not collected yet): tqdm gave the step line the next free position, a
    newline and cursor-up codes (this test failed in whichever test process an earlier test's bar lived on)."""
    monkeypatch.setenv("COLUMNS", "120")  # a terminal the line fits in (pytest-xdist's workers say 80: tqdm cut it)
    other = tqdm(total=5, file=io.StringIO()) if other_bar else None
    out = _Terminal()
    _steps(Console(out))
    if other is not None:
        other.close()
    text = out.getvalue()
    assert "\r[diffrl] step 1/3 |" in text and "| reward 0.4583, 16.08 images/s (2.98 s), eta 0m06s" in text
    assert "\n[diffrl] step 1/3" not in text and "\x1b[A" not in text  # no new line of its own, no cursor moves
    lines = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]  # what the terminal shows of each line
    assert lines[0] == "[diffrl] before training: val/reward 0.4222"
    assert "[diffrl] a note between steps" in lines and "[diffrl] step 3/3: val/reward 0.5245" in lines
    final = next(line for line in lines if line.startswith("[diffrl] step 3/3 |"))
    assert final.endswith("| reward 0.5590, 11.96 images/s (4.01 s)")  # the last state stays on screen
    assert lines[-2] == "[diffrl] done." and lines[-1] == ""


def test_a_log_file_gets_one_plain_line_per_step():
    out = io.StringIO()  # not a TTY: a log file, CI, a Prefect worker's captured output
    _steps(Console(out))
    assert out.getvalue().splitlines() == [
        "[diffrl] before training: val/reward 0.4222",
        "[diffrl] step 1/3: reward 0.4583, 16.08 images/s (2.98 s), eta 0m06s",
        "[diffrl] step 2/3: reward 0.3854, 18.27 images/s (2.63 s), eta 0m03s",
        "[diffrl] a note between steps",
        "[diffrl] step 3/3: reward 0.5590, 11.96 images/s (4.01 s) | val/reward 0.5245",
        "[diffrl] done.",
    ]
