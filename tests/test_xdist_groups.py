"""`make test`'s grouping (tests/conftest.py `pytest_xdist_make_scheduler`), on a small suite run with the same
`-n 2 --dist loadgroup`: the tests under tests/cluster share one worker (one Ray cluster), and each other file runs on
one worker, so its module fixture is set up once; the heavy folders (tests/e2e here) are handed out first. xdist's own
loadgroup grouped nothing under pytest 9.2 and set up every module fixture on both workers; this catches such a change
of either package."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")


def _module(log: str, name: str, tests: int = 4) -> str:
    return textwrap.dedent(
        f"""
        import os
        import time

        import pytest


        @pytest.fixture(scope="module")
        def shared():
            with open({log!r}, "a") as f:
                f.write("setup {name} %d\\n" % os.getpid())
            return 1


        @pytest.mark.parametrize("i", range({tests}))
        def test_one(shared, i):
            time.sleep(0.05)
            with open({log!r}, "a") as f:
                f.write("test {name} %d\\n" % os.getpid())
        """
    )


def test_make_test_keeps_the_cluster_tests_on_one_worker_and_sets_module_fixtures_up_once(tmp_path):
    log = str(tmp_path / "log")
    files = {
        "cluster/test_a.py": "a",
        "cluster/test_b.py": "b",
        "engines/test_c.py": "c",
        "test_d.py": "d",
        "e2e/test_e.py": "e",
        "algorithms/test_f.py": "f",
    }
    for path, name in files.items():
        target = tmp_path / "tests" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(_module(log, name, tests=6 if name == "f" else 4))
    (tmp_path / "tests" / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('diffrl_tests_conftest', {CONFTEST!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "pytest_xdist_make_scheduler = module.pytest_xdist_make_scheduler\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-n", "2", "--dist", "loadgroup", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line.split() for line in open(log).read().splitlines()]
    setups = sorted(name for kind, name, _ in lines if kind == "setup")
    assert setups == ["a", "b", "c", "d", "e", "f"], lines  # each module fixture once
    workers = {name: {pid for kind, n, pid in lines if kind == "test" and n == name} for name in files.values()}
    assert all(len(pids) == 1 for pids in workers.values()), workers  # a file stays on its worker
    assert workers["a"] == workers["b"], workers  # tests/cluster: one worker
    assert len({pid for _, _, pid in lines}) == 2  # and the suite did run on two workers
    # the heavy folders are handed out first, one unit to each worker: tests/e2e (4 tests) starts before the unit-test
    # files, where xdist's own order (most tests first) hands out tests/algorithms' file of 6 before it
    order = [name for kind, name, _ in lines if kind == "setup"]
    assert order.index("e") < min(order.index(n) for n in "cdf"), order
