"""Docs, YAML headers and code comments say what is, for a user (CONTRIBUTING.md, "Docs and comments").

History lives in git: no commit hashes, no issue or pull-request numbers, no account of past work sessions, and no
pointers to files that are not in the repository. This test reads every line of README.md, CONTRIBUTING.md and docs/,
the comments of diffrl/configs/*.yaml, and the comments and docstrings of the Python and shell files under diffrl/,
benchmarks/ and tests/ (string literals that are data are not read), and names each offending file:line. The last two
tests show what each rule finds and what it leaves alone.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from collections.abc import Iterator

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 7 to 40 lowercase hex characters with at least one digit and one letter, as a whole word. A sha256 digest (64) is
# no whole word of 7-40, and dtype names or numbers in exponent form are too short or not hex.
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
# the words issue / PR / pull request followed by a number, or a number right after a hash sign (a Markdown heading
# has a space there)
ISSUE_NUMBER = re.compile(r"\b(?:issues?|PRs?|pull requests?)\s+#?\d+|(?<![\w&#/])#\d{1,5}\b", re.IGNORECASE)
SESSION_HISTORY = re.compile(
    r"\b(?:this|last|previous|next|a later|an earlier) (?:GPU )?session\b"
    r"|since this was recorded|before this change|\btoday's\b"
    # the past-habit phrase (what code did once), not its passive form after is, are, be, was, ...
    r"|(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bwas )(?<!\bwere )(?<!\bbeen )(?<!\bbeing )\bused to\b",
    re.IGNORECASE,
)
# the project's design and notes files and the folder beside the checkout are not part of the repository
OUTSIDE_FILE = re.compile(r"\b(?:DESIGN|NOTES)\.md\b|\bDESIGN (?:section|§)|\bDESIGN §|\.\./shared/")

RULES = {
    "commit hash": COMMIT_HASH,
    "issue number": ISSUE_NUMBER,
    "session history": SESSION_HISTORY,
    "file outside the repository": OUTSIDE_FILE,
}

# (path, matched text) -> why it is not history. Keep this list short and each entry narrow.
ALLOWED: dict[tuple[str, str], str] = {
    ("docs/operations.md", "1e606f3d"): "a Ray node id in an example error message",
    ("diffrl/engines/cluster.py", "1e606f3d"): "a Ray node id in an example error message",
}

PYTHON_ROOTS = ("diffrl", "benchmarks", "tests")
SKIP_DIRS = {"__pycache__", ".venv", "node_modules"}


def _files(root: str, suffixes: tuple[str, ...]) -> Iterator[str]:
    for folder, dirs, names in os.walk(os.path.join(REPO, root)):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(names):
            if name.endswith(suffixes):
                yield os.path.relpath(os.path.join(folder, name), REPO)


def _read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def _whole_lines(path: str) -> Iterator[tuple[int, str]]:
    yield from enumerate(_read(path).splitlines(), start=1)


def _hash_comments(path: str) -> Iterator[tuple[int, str]]:
    """The comment part of each line of a YAML or shell file: from a '#' at the start or after a space."""
    for number, line in enumerate(_read(path).splitlines(), start=1):
        match = re.search(r"(?:^|\s)#.*$", line)
        if match:
            yield number, match.group(0)


def _python_comments(path: str) -> Iterator[tuple[int, str]]:
    """The comments and the docstrings (module, class, function) of a Python file, line by line."""
    source = _read(path)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    for number in range(first.lineno, (first.end_lineno or first.lineno) + 1):
                        yield number, lines[number - 1]


def scanned() -> Iterator[tuple[str, int, str]]:
    """(path, line number, text) of every line these rules apply to."""
    docs = ["README.md", "CONTRIBUTING.md", *_files("docs", (".md",))]
    for path in docs:
        if os.path.exists(os.path.join(REPO, path)):
            for number, text in _whole_lines(path):
                yield path, number, text
    for path in _files(os.path.join("diffrl", "configs"), (".yaml", ".yml")):
        for number, text in _hash_comments(path):
            yield path, number, text
    for root in PYTHON_ROOTS:
        for path in _files(root, (".py",)):
            for number, text in _python_comments(path):
                yield path, number, text
        for path in _files(root, (".sh",)):
            for number, text in _hash_comments(path):
                yield path, number, text


def violations(lines) -> list[str]:
    found = []
    for path, number, text in lines:
        for rule, pattern in RULES.items():
            for match in pattern.finditer(text):
                if (path, match.group(0)) not in ALLOWED:
                    found.append(f"{path}:{number}: {rule} {match.group(0)!r}: {text.strip()[:120]}")
    return sorted(set(found))


def test_docs_configs_and_comments_carry_no_history():
    found = violations(scanned())
    assert not found, f"{len(found)} lines carry history (git keeps it; say what is, and why):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text",
    [
        "measured at commit 5c3b376",
        "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678",
        "see issue 54",
        "issues 35 and 39",
        "(#54)",
        "measured this session",
        "in the previous session",
        "since this was recorded",
        "today's colocated mode",
        "see ../shared/tools/x",
        "DESIGN.md section 2",
    ],
)
def test_the_rules_find_history(text):
    assert violations([("x.md", 1, text)]), text


@pytest.mark.parametrize(
    "text",
    [
        "sha256 " + "0123456789abcdef" * 4,  # a digest is not a commit
        "color: #a0b1c2; fp32, bf16, 1.0e-4, e4m3, 2026-12-04, 1,024 tokens",
        "# 2. a numbered Markdown heading",
        "the DCP shards of step 12; results/*.json; deadbeef is a word without digits",
        "a test session fixture",
    ],
)
def test_the_rules_leave_ordinary_text_alone(text):
    assert not violations([("x.md", 1, text)]), text


@pytest.mark.parametrize("doc", ["docs/performance.md", "docs/reference-model.md"])
def test_the_measurement_docs_stay_under_300_lines(doc):
    """The current figures, how they were measured and how to reproduce them; a past figure lives in git."""
    with open(os.path.join(REPO, doc), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) < 300, f"{doc} has {len(lines)} lines: keep the current figures only"
