"""A full disk (docs/operations.md "What happens when"): the run stops with "No space left on device";
once there is space again, the same command resumes it and every chunk of every step is stored once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from e2e_settings import TINY

# In a private mount namespace (unshare -rm: no root needed, nothing mounted outside it): runs/ on a 700 KB tmpfs,
# which fills within the first steps of the tiny run; then the tmpfs grows and the same command runs again.
SCRIPT = """
set -e
mkdir -p runs
mount -t tmpfs -o size=700k tmpfs runs
set +e
"$@" > first.out 2> first.err; echo $? > first.rc
mount -o remount,size=64m runs
"$@" > second.out 2> second.err; echo $? > second.rc
{python} -c "
import json, lance
t = lance.dataset('runs/quickstart/trajectories.lance').to_table(columns=['step', 'chunk'])
json.dump([t.column('step').to_pylist(), t.column('chunk').to_pylist()], open('rows.json', 'w'))
"
"""


def _private_mounts_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _private_mounts_work(), reason="needs unshare -rm and tmpfs mounts in a user namespace")
def test_a_full_disk_stops_the_run_and_the_same_command_resumes_it(workdir):
    command = [sys.executable, "-m", "diffrl.flows.cli", "train", *TINY, "run.steps=4"]
    script = SCRIPT.format(python=sys.executable)
    subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *command], cwd=workdir, check=True, timeout=900)
    first_err = (workdir / "first.err").read_text()
    assert (workdir / "first.rc").read_text().strip() == "1", first_err[-2000:]
    assert "No space left on device" in first_err
    last = first_err.strip().splitlines()[-1]  # one line, and the advice that fits a full disk
    assert last.startswith("diffrl train: error: ") and "free space, then rerun the same command to resume" in last
    assert (workdir / "second.rc").read_text().strip() == "0", (workdir / "second.err").read_text()[-2000:]
    steps, chunks = json.loads((workdir / "rows.json").read_text())  # read inside the namespace, where runs/ is
    rows = list(zip(steps, chunks))
    assert {k: rows.count(k) for k in set(rows)} == {(s, c): 4 for s in range(1, 5) for c in range(2)}  # each once
