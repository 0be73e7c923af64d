"""`diffrl config show --doc` and docs/configuration.md: every key with its type, default, allowed values and meaning,
read from the schema (diffrl/configs/doc.py)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass, field

from diffrl.configs.doc import _allowed, _meaning, key_docs, render_markdown
from diffrl.configs.loader import to_dict
from diffrl.configs.schema import ExperimentConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(REPO, "docs", "configuration.md")


def test_the_page_is_what_config_show_doc_prints():
    proc = subprocess.run(
        [sys.executable, "-m", "diffrl", "config", "show", "--doc"], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == render_markdown(key_docs())
    with open(PAGE) as f:
        page = f.read()
    assert page == proc.stdout, (
        "docs/configuration.md is out of date with the schema: regenerate it with "
        "`diffrl config show --doc > docs/configuration.md`"
    )


def _leaves(node, prefix: str):
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix


def test_every_key_config_show_prints_is_described():
    docs = key_docs()
    keys = [d.key for d in docs]
    assert len(keys) == len(set(keys))
    shown = set(_leaves(to_dict(ExperimentConfig()), ""))
    assert shown - set(keys) == set()
    undescribed = [d.key for d in docs if not d.meaning]
    assert len(undescribed) <= 2, f"keys without a comment in the schema: {undescribed}"


def test_allowed_values_come_from_the_schemas_own_checks():
    allowed = {d.key: d.allowed for d in key_docs()}
    assert allowed["model.dtype"] == "one of auto, fp32, bf16, fp16"
    assert allowed["train.lr"] == "> 0"
    assert allowed["rollout.top_p"] == "in (0, 1]"
    assert allowed["rollout.chunk_size"] == ">= 1"
    assert allowed["cluster.gpus"] == "a number of GPUs >= 1 or 'auto'"  # not the check across cluster fields
    assert allowed["algorithm.name"].startswith("one of ") and "flow_grpo" in allowed["algorithm.name"]
    assert allowed["train.shuffle"] == ""  # a bool: nothing to state


@dataclass
class _Example:
    """An example section.

    documented: said in the docstring. pair_a, pair_b: said together.
    """

    trailing: int = 1  # said on its line
    # said on the lines
    # above it
    above: str = "x"
    wrapped: str = "y"  # said inside the parentheses
    documented: float = 0.5
    pair_a: int = 0
    pair_b: int = 0
    checked: int = 3
    nothing: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.checked < 1:
            raise ValueError(f"example.checked must be >= 1 (one or more); got {self.checked}")


def test_meaning_is_the_fields_comment_or_its_docstring_entry():
    said = {f.name: _meaning(_Example, f.name) for f in dataclasses.fields(_Example)}
    assert said == {
        "trailing": "said on its line",
        "above": "said on the lines above it",
        "wrapped": "said inside the parentheses",
        "documented": "said in the docstring.",
        "pair_a": "said together.",
        "pair_b": "said together.",
        "checked": "",
        "nothing": "",
    }
    [checked] = [f for f in dataclasses.fields(_Example) if f.name == "checked"]
    assert _allowed(_Example(), checked) == ">= 1 (one or more)"
