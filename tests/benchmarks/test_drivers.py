"""The benchmark drivers as the docs run them: modules of the `benchmarks` package, started from the repository root
as `python -m benchmarks.<name>`. No file under benchmarks/ edits the import path, every driver imports and answers
`--help` without building a model, and the drivers' imports of each other form no cycle."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(REPO, "benchmarks")


def _modules() -> dict[str, str]:
    """name -> source of every Python module of the benchmarks package."""
    sources = {}
    for name in sorted(os.listdir(BENCHMARKS)):
        if name.endswith(".py") and name != "__init__.py":
            with open(os.path.join(BENCHMARKS, name), encoding="utf-8") as f:
                sources[name[:-3]] = f.read()
    return sources


MODULES = _modules()
DRIVERS = [name for name, source in MODULES.items() if 'if __name__ == "__main__":' in source]


def test_no_benchmark_file_edits_the_import_path():
    found = []
    for folder, dirs, names in os.walk(BENCHMARKS):
        dirs[:] = [d for d in dirs if d not in ("results", "__pycache__")]
        for name in names:
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8", errors="replace") as f:
                found += [f"{os.path.relpath(path, REPO)}:{i}" for i, line in enumerate(f, 1) if "sys.path" in line]
    assert not found, "benchmarks import diffrl (installed) and each other as benchmarks.<name>:\n" + "\n".join(found)


@pytest.mark.parametrize("name", DRIVERS)
def test_every_driver_answers_help(name, monkeypatch, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(sys, "argv", [f"benchmarks.{name}", "--help"])
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code in (0, None) and "usage:" in capsys.readouterr().out


def _imported(source: str) -> set[str]:
    """The benchmark modules a source imports, at module level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
    return names & set(MODULES)


def test_benchmark_imports_form_no_cycle():
    graph = {name: _imported(source) for name, source in MODULES.items()}
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        for other in sorted(graph[name]):
            if other in path:
                loop = path[path.index(other) :]
                first = loop.index(min(loop))  # each cycle once, from its first name
                loop = loop[first:] + loop[:first]
                cycles.append(" -> ".join([*loop, loop[0]]))
            else:
                visit(other, [*path, other])

    for name in graph:
        visit(name, [name])
    assert not cycles, "import cycles among the benchmark modules:\n" + "\n".join(sorted(set(cycles)))


def test_a_driver_runs_as_a_module_from_the_repository_root(tmp_path):
    """The documented way, in a fresh interpreter: the package resolves from the working directory."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.scaling_model", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]
