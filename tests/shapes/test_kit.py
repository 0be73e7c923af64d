"""The shapes kit is a plug-in: the engines never import it, and its rewards keep their config names.

pyproject's import-linter contracts check the static imports; these tests check what they cannot see, a module named
in a string (an importlib call, a registry declaration), and that the registry finds the kit's rewards in a process
that imported only the engines.
"""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BELOW_THE_KIT = ("engines", "models", "algorithms", "configs")


def test_no_layer_below_the_kit_names_its_modules():
    """A module under engines, models, algorithms or configs that names diffrl.shapes (even in a string that is
    imported at run time) would make the kit a dependency of the layers it builds on."""
    found = []
    for package in BELOW_THE_KIT:
        for folder, _, names in os.walk(os.path.join(REPO, "diffrl", package)):
            for name in sorted(n for n in names if n.endswith(".py")):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, start=1):
                        if "diffrl.shapes" in line:
                            found.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    assert not found, "modules below the shapes kit name it:\n" + "\n".join(found)


def test_the_kits_rewards_are_built_by_name_where_only_the_engines_were_imported():
    script = (
        "import sys\n"
        "from diffrl.engines.reward.base import build_reward\n"
        "from diffrl.configs.reward import RewardComponent, RewardConfig\n"
        "from diffrl.engines.reward.multi import MultiReward\n"
        "assert not [m for m in sys.modules if m.startswith('diffrl.shapes')], 'the engines imported the kit'\n"
        "print(type(build_reward('geneval_lite', {'strict_weight': 0.5})).__module__)\n"
        "pool = MultiReward(RewardConfig(components=[RewardComponent('shapes_edit')]))\n"
        "print(type(pool.rewards['shapes_edit']).__module__)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["diffrl.shapes.geneval_lite", "diffrl.shapes.edit_reward"]
