"""Held-out accuracy of omni_quick runs in detail: per question type, and on the held-out questions that neither the
warm start nor the run trained on.

The scene questions come from a small space (a one-object scene has 15 descriptions), so some held-out questions
also occur, word for word, among a run's 4000 training questions (71-82 of the 192 for seeds 0-2) or the warm
start's. `val/reward` counts every held-out question; this script also reports the accuracy on the `unseen` ones.
It decodes greedily as the run's validation does (diffrl/engines/step/plan.validation_rollout), with the warm start
(before) and with the policy of the run's latest checkpoint (after), on the same questions.

    python -m benchmarks.omni_quick_heldout --root /tmp/runs omni-quick-s0 omni-quick-s1 omni-quick-s2
"""

from __future__ import annotations

import argparse
import json
import os

from diffrl.configs.schema import load_experiment
from diffrl.engines.step.plan import validation_rollout
from diffrl.engines.step.update import checkpoint_dir, latest_checkpoint
from diffrl.flows.build import build_engines
from diffrl.shapes.pretrain.thinker import TRAIN_SEED
from diffrl.shapes.questions import scene_questions


def answers(engines) -> tuple[list[str], list[str], list[float]]:
    """(prompts, question types, 1.0/0.0 right) of greedy answers to the run's validation prompts."""
    traj = validation_rollout(engines.rollout, engines.config, engines.val_prompts)
    right = engines.reward(traj.outputs, traj.prompts, traj.metadata).scores.tolist()
    return traj.prompts, [m["question_type"] for m in traj.metadata], right


def accuracies(prompts: list[str], kinds: list[str], right: list[float], seen: set[str]) -> dict[str, float]:
    """Accuracy over all questions, per question type, and over the unseen / seen ones."""
    groups: dict[str, list[float]] = {"all": right}
    for prompt, kind, ok in zip(prompts, kinds, right):
        groups.setdefault(kind, []).append(ok)
        groups.setdefault("unseen" if prompt not in seen else "seen", []).append(ok)
    return {k: sum(v) / len(v) for k, v in groups.items()}


def evaluate(run_name: str, root: str, seed: int) -> dict:
    """Before (the warm start) and after (the run's latest checkpoint), on the same questions; a question is seen
    when it is among the warm start's or the run's training questions."""
    overrides = [f"run.root={root}", f"run.seed={seed}", f"run.name={run_name}", "data.num_val_prompts=192"]
    cfg = load_experiment("omni_quick", overrides)
    engines = build_engines(cfg, durable=False)
    try:
        seen = {r.prompt for r in scene_questions(4000, TRAIN_SEED, None).records}  # the warm start's
        seen |= {r.prompt for r in engines.prompts.dataset.records}  # the run's own training questions
        before = answers(engines)
        step = latest_checkpoint(cfg.run_dir)
        if step is None:
            raise ValueError(f"run {run_name!r} has no checkpoint under {cfg.run_dir}")
        engines.trainer.load_checkpoint(os.path.abspath(checkpoint_dir(cfg.run_dir, step)))
        after = answers(engines)
    finally:
        engines.memory.close()
    unseen = sum(p not in seen for p in before[0])
    return {
        "run": run_name,
        "seed": seed,
        "unseen_count": unseen,
        "before": accuracies(*before, seen),
        "after": accuracies(*after, seen),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run names (omni-quick-s<seed>: the seed is read from the name)")
    parser.add_argument("--root", default="runs", help="the runs' run.root")
    args = parser.parse_args(argv)
    results = [evaluate(name, args.root, int(name.rsplit("-s", 1)[-1])) for name in args.runs]
    for r in results:
        print(json.dumps(r))
    return results


if __name__ == "__main__":
    main()
