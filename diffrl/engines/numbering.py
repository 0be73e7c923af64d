"""Step numbers: what a person sees counts a run's RL steps from 1; the code counts them from 0.

The step index (0, 1, ...) is how the code counts: loops, sample seeds, the prompt order, Prefect cache keys and
persisted result names, the TrajectoryStore API. The step number (1, 2, ...) is what every surface shows: step k is
the k-th RL step, and k RL steps are done once it has run. The console (`step k/N`), MLflow's step axis (step k's
metrics at k; validation before training at 0), `checkpoints/step_<k>` (the weights after step k) and
`latest.json`, `trainer_state.json`'s step, the `step` column of the Lance tables, Prefect's run names
(`generate-step<k>-chunk<c>`, `<run>-step-<k>`), the fault spec `stage@k`, `diffrl export --step k` and the
evaluation's MLflow step all use the number. These two functions are where one becomes the other (and `counted`
writes a count with its noun).
"""

from __future__ import annotations


def step_number(index: int) -> int:
    """The step number a person sees for the code's step `index` (0 -> 1)."""
    return int(index) + 1


def step_index(number: int) -> int:
    """The code's step index of step `number` (1 -> 0)."""
    return int(number) - 1


def counted(n: int, noun: str) -> str:
    """`1 step`, `3 steps`: a count and its noun, plural when the count is not 1 (nouns that take an s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
