"""What the flow, the tasks and the stages hand each other: typed engines (diffrl/engines/handle.py: `Engines` where
they live, an `EngineHandle` to run stage functions there), one registry of a run's engines (diffrl/engines/cluster.py)
and flow parameters, not environment variables, for what `diffrl train` tells its flow; configs inside the layer
contract and no import cycles."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import grimp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEARCHED = ("diffrl", "benchmarks", "docs", "tools")
# a cycle kept on purpose, with its reason
ALLOWED_CYCLES = {
    # build_reward builds a user's `module:function` reward (imported lazily there); user.py builds on base's outputs
    frozenset({"diffrl.engines.reward.base", "diffrl.engines.reward.user"}),
}


def _sources(*folders: str, suffixes: tuple[str, ...] = (".py", ".md", ".sh", ".yaml")):
    for folder in folders:
        for base, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in names:
                if name.endswith(suffixes):
                    path = os.path.join(base, name)
                    with open(path, encoding="utf-8") as f:
                        yield os.path.relpath(path, ROOT), f.read()


def test_no_parameter_is_typed_engines_any():
    found = [
        f"{path}:{n}"
        for path, text in _sources("diffrl", suffixes=(".py",))
        for n, line in enumerate(text.splitlines(), 1)
        if re.search(r"\bengines: Any\b", line)
    ]
    assert not found, "type engines as Engines or EngineHandle (diffrl/engines/handle.py):\n" + "\n".join(found)


def test_diffrl_train_tells_its_flow_through_parameters_not_the_environment():
    names = ("DIFFRL_COMMAND_AT", "DIFFRL_FLOW_CALLED_AT", "DIFFRL_PREPARED_S")
    found = [f"{path}: {name}" for path, text in _sources(*SEARCHED) for name in names if name in text]
    assert not found, "\n".join(found)


def test_the_engines_of_a_run_have_one_registry():
    assert not os.path.exists(os.path.join(ROOT, "diffrl", "flows", "early.py"))
    registries = [
        f"{path}:{n}"
        for path, text in _sources("diffrl", suffixes=(".py",))
        for n, line in enumerate(text.splitlines(), 1)
        if re.match(r"_(ENGINES|VALIDATION)\b.*=", line)
    ]
    assert registries == [f"{os.path.join('diffrl', 'engines', 'cluster.py')}:{_line('_ENGINES')}"]


def _line(name: str) -> int:
    with open(os.path.join(ROOT, "diffrl", "engines", "cluster.py"), encoding="utf-8") as f:
        return next(n for n, line in enumerate(f, 1) if line.startswith(name))


def test_configs_is_a_layer_and_the_contracts_hold():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        layers = re.search(r'type = "layers"\n(?:#.*\n)*layers = \[(.*?)\]', f.read(), re.S).group(1)
    assert '"diffrl.configs"' in layers
    lint = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([lint, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_no_import_cycles_at_run_time():
    """Imports under `if TYPE_CHECKING:` name types only and are left out."""
    graph = grimp.build_graph("diffrl", cache_dir=None, exclude_type_checking_imports=True)
    cycles = [c for c in _cycles(graph) if frozenset(c) not in ALLOWED_CYCLES]
    assert not cycles, "modules that import each other (directly or through others):\n" + "\n".join(map(str, cycles))


def _cycles(graph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            for j in range(i, len(edges[node])):
                nxt = edges[node][j]
                if nxt not in index:
                    work += [(node, j + 1), (nxt, 0)]
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return groups
