"""A module whose import is recorded: its import appends a line to the file DIFFRL_TEST_IMPORT_MARKER names. Tests
name it where it must never be imported from (a config parsed but not built, a run folder's recorded config)."""

import os

if os.environ.get("DIFFRL_TEST_IMPORT_MARKER"):
    with open(os.environ["DIFFRL_TEST_IMPORT_MARKER"], "a") as f:
        f.write(f"imported in process {os.getpid()}\n")


def score(images, prompts, metadata):
    return [0.0] * len(images)
