"""`diffrl train`'s console lines.

On a terminal the steps are one live line, rewritten in place after each step:

    [diffrl] step 12/60 |#####               | reward 0.4312, 11.96 images/s (4.01 s), eta 3m10s

and every other line of the run (validation results, resume notes, the summary) is printed above it. Anywhere else
(a log file, CI, a Prefect worker's captured output) each step is one plain line, as a log should have:

    [diffrl] step 12/60: reward 0.4312 11.96 images/s (4.01 s), eta 3m10s

The live line is a tqdm bar (tqdm is a dependency already): its lock keeps the rollout's own sampling bar, drawn
from the rollout thread below it, from tearing the line.
"""

from __future__ import annotations

import shutil
import sys
from typing import TextIO

from tqdm import tqdm

PREFIX = "[diffrl] "
BAR_FORMAT = PREFIX + "step {n_fmt}/{total_fmt} |{bar:20}| {desc}"  # desc: the status, as given


class Console:
    """The run's console: plain `[diffrl]` lines, and the step line (live on a terminal)."""

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None):
        self._stream = stream
        self._live = live
        self._bar: tqdm | None = None

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stderr  # looked up late: pytest and callers may swap sys.stderr

    @property
    def live(self) -> bool:
        if self._live is not None:
            return self._live
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def say(self, message: str) -> None:
        """One line, above the live step line when there is one."""
        if self._bar is not None:
            self._bar.write(PREFIX + message, file=self.stream)
        else:
            print(PREFIX + message, file=self.stream, flush=True)

    def step(self, done: int, total: int, status: str, *, note: str = "") -> None:
        """Step `done` of `total` finished: `status` is its reward, speed and time left; `note` (validation results)
        is printed as a line of its own on a terminal and after the status elsewhere."""
        if not self.live:
            self.say(f"step {done}/{total}: {status}" + (f" | {note}" if note else ""))
            return
        if note:  # a line of its own, above the live line
            self.say(f"step {done}/{total}: {note}")
        if self._bar is None or self._bar.total != total:
            self.close()
            # the terminal's size, 100x24 where it says 0 (a pty nobody sized): tqdm draws nothing at 0 rows
            size = shutil.get_terminal_size((100, 24))
            self._bar = tqdm(
                total=total,
                initial=done,
                desc=status,
                file=self.stream,
                bar_format=BAR_FORMAT,
                ncols=size.columns,
                nrows=size.lines,
                # the cursor's line, whatever other bars are alive: tqdm would give a new bar the first free
                # position, and any bar not closed (a library's, a failed stage's) moved the step line below it with
                # a newline and cursor-up codes
                position=0,
            )
            return
        self._bar.set_description_str(status, refresh=False)
        self._bar.update(done - self._bar.n)
        self._bar.refresh()  # update() may skip the redraw (tqdm's mininterval)

    def close(self) -> None:
        """End the live line (it stays on screen as the last step's state)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


console = Console()  # the process's console: `diffrl train` writes on stderr
