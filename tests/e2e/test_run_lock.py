"""One writer per run: a second `diffrl train` of a run that a live process trains is refused
with the holder's pid and host; the lock of a process that died is taken over."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest
from e2e_settings import TINY

from diffrl.flows.cli import main
from diffrl.flows.run_lock import RunLocked, run_lock
from diffrl.flows.train import train

# A process that holds the run's lock until it is killed (as a `diffrl train` does while it trains).
HOLD = """
import sys, time
from diffrl.flows.run_lock import run_lock
with run_lock(sys.argv[1], "quickstart"):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder(workdir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, "runs/quickstart"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_writer_is_refused_with_the_holders_pid_and_host(holder, capfd):
    refusal = rf"run 'quickstart' \(.*\) is being trained by pid {holder.pid} on host {re.escape(socket.gethostname())}"
    with pytest.raises(RunLocked, match=refusal):
        train(config=None, overrides=TINY + ["run.steps=1"])
    assert sorted(os.listdir("runs/quickstart")) == ["run.lock"] and not os.path.exists("mlflow.db")  # nothing ran
    # `diffrl train`, in this process (main is what the `diffrl` script calls; a fresh interpreter's imports would be
    # nearly all of this refusal's time): exit 2, the refusal in one line on stderr (fd 2)
    capfd.readouterr()
    code = main(["train", *TINY, "run.steps=1"])
    err = capfd.readouterr().err
    assert code == 2 and re.search(refusal, err) and "Traceback" not in err
    holder.kill()  # killed: the kernel drops its lock; the file still names it
    holder.wait()
    assert train(config=None, overrides=TINY + ["run.steps=1"])["last_step"] == 1
    assert f"taking over the lock runs/quickstart/run.lock left by pid {holder.pid}" in capfd.readouterr().err
    with open("runs/quickstart/run.lock") as f:
        assert f.read() == ""  # released cleanly: the next run has no holder to report


def test_the_lock_names_its_holder_while_it_is_held(workdir):
    with run_lock("runs/quickstart", "quickstart"):
        with open("runs/quickstart/run.lock") as f:
            assert json.load(f)["pid"] == os.getpid()
        with run_lock("runs/quickstart", "quickstart"):  # the same process again (the CLI, then its flow)
            pass
    with open("runs/quickstart/run.lock") as f:
        assert f.read() == ""
