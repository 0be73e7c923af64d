"""Every shell block README.md, CONTRIBUTING.md and docs/ show is run here, or says why it cannot be.

The convention (CONTRIBUTING.md, "Docs and comments"): the line before a shell block is a marker,

    <!-- run: cpu -->                  this test runs the block on the CPU, in a scratch folder
    <!-- skip: gpu -->                 needs a GPU (and usually real-size weights)
    <!-- skip: server -->              needs a server or service left running (Prefect, Ray, vLLM, a UI)
    <!-- skip: multi-node -->          needs several machines
    <!-- skip: too long for CI -->     runs on a CPU, but for minutes (or needs such a run first)
    <!-- skip: needs your files -->    needs files only a user has (images, model folders, a dataset)

A shell block is a fenced block tagged bash, sh, shell or console, or any other fenced or indented code block with a
line that starts a diffrl, python, make, pip, prefect, ray or mlflow command. A runnable block runs with
`bash -euo pipefail` in a scratch folder that links the repository's top-level entries (so `diffrl/configs/...` and
`benchmarks/...` resolve) and `.venv` to the environment running this test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_REASONS = ("gpu", "server", "multi-node", "too long for CI", "needs your files")
MARKER = re.compile(r"^\s*<!--\s*(run|skip):\s*(.+?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
COMMAND = re.compile(
    r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"  # leading VAR=value assignments
    r"(?:\.venv/bin/)?(?:diffrl|python3?|make|pip|prefect|ray|mlflow|bash|export|lint-imports|ruff|pytest)"
    r"(?:\s+(?![\w-]+:(?:\s|$))|$)"  # not "diffrl train: error ..." (printed output)
)
BLOCK_TIMEOUT_S = 300


@dataclass
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence (or the first indented line)
    body: str
    marker: tuple[str, str] | None  # ("run", "cpu") or ("skip", reason)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def _doc_files() -> list[str]:
    files = [name for name in ("README.md", "CONTRIBUTING.md") if os.path.exists(os.path.join(REPO, name))]
    for folder, dirs, names in os.walk(os.path.join(REPO, "docs")):
        dirs.sort()
        files += sorted(os.path.relpath(os.path.join(folder, n), REPO) for n in names if n.endswith(".md"))
    return files


def _has_command(body: list[str]) -> bool:
    return any(COMMAND.match(line.strip()) for line in body)


def _marker_before(lines: list[str], index: int) -> tuple[str, str] | None:
    """The marker on the nearest non-blank line above line `index` (0-based), if that line is one."""
    j = index - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    match = MARKER.match(lines[j]) if j >= 0 else None
    return (match.group(1), match.group(2)) if match else None


def shell_blocks(path: str) -> list[Block]:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence:
            indent, ticks, lang = fence.groups()
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(ticks):
                j += 1
            body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : j]]
            if lang in SHELL_LANGS or (lang == "" and _has_command(body)):
                blocks.append(Block(path, i + 1, "\n".join(body), _marker_before(lines, i)))
            i = j + 1
            continue
        # an indented code block: four spaces after a blank line, holding a command
        if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            body = [line[4:] for line in lines[i:j]]
            if _has_command(body):
                blocks.append(Block(path, i + 1, "\n".join(body).strip("\n"), _marker_before(lines, i)))
            i = j
            continue
        i += 1
    return blocks


ALL_BLOCKS = [block for path in _doc_files() for block in shell_blocks(path)]
RUNNABLE = [block for block in ALL_BLOCKS if block.marker == ("run", "cpu")]


def test_every_shell_block_is_marked():
    unmarked = [block.id for block in ALL_BLOCKS if block.marker is None]
    assert not unmarked, (
        "shell blocks without a marker on the line before them (<!-- run: cpu --> or <!-- skip: REASON -->, REASON "
        f"one of {SKIP_REASONS}):\n" + "\n".join(unmarked)
    )
    bad = [
        f"{block.id}: {block.marker}"
        for block in ALL_BLOCKS
        if block.marker is not None and block.marker != ("run", "cpu") and block.marker[1] not in SKIP_REASONS
    ]
    assert not bad, f"unknown markers (run: cpu, or skip: one of {SKIP_REASONS}):\n" + "\n".join(bad)


def test_every_marker_stands_before_a_shell_block():
    marked_lines = {(block.path, block.line) for block in ALL_BLOCKS if block.marker}
    orphans = []
    for path in _doc_files():
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            lines = f.read().splitlines()
        for number, line in enumerate(lines, start=1):
            if MARKER.match(line):
                after = number + 1
                while after <= len(lines) and not lines[after - 1].strip():
                    after += 1
                if (path, after) not in marked_lines:
                    orphans.append(f"{path}:{number}")
    assert not orphans, "markers with no shell block right after them:\n" + "\n".join(orphans)


def test_the_block_finder_sees_fenced_and_indented_commands(tmp_path, monkeypatch):
    doc = tmp_path / "docs" / "x.md"
    doc.parent.mkdir()
    doc.write_text(
        "<!-- run: cpu -->\n```bash\necho hi\n```\n\n```\n[diffrl] output, not a command\n```\n\n"
        "Text:\n\n    python benchmarks/x.py --out y.json\n\n"
        "<!-- skip: gpu -->\n```\nOMP_NUM_THREADS=1 diffrl train\n```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    blocks = shell_blocks("docs/x.md")
    assert [(b.line, b.marker) for b in blocks] == [(2, ("run", "cpu")), (12, None), (15, ("skip", "gpu"))]
    assert blocks[1].body == "python benchmarks/x.py --out y.json"


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.id for block in RUNNABLE])
def test_a_cpu_block_runs_as_written(block, tmp_path):
    venv = sys.prefix
    if not os.path.exists(os.path.join(venv, "bin", "diffrl")):
        pytest.skip(f"the `diffrl` command is not installed in {venv} (make install puts it in .venv)")
    for name in os.listdir(REPO):
        if name not in (".git", ".venv", "runs", "mlflow.db", "mlartifacts"):
            os.symlink(os.path.join(REPO, name), tmp_path / name)
    os.symlink(venv, tmp_path / ".venv")
    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.body],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert done.returncode == 0, (
        f"{block.id} exited {done.returncode}:\n{block.body}\n--- stdout\n{done.stdout[-3000:]}"
        f"\n--- stderr\n{done.stderr[-3000:]}"
    )
