"""Every shipped CPU demo learns, and its run repeats no warning.

The demos (diffrl/configs): `quickstart` (DiffusionNFT on shapes-small; `shapes_quick` is the same recipe under
other names, tests/configs/test_schema.py), `quickstart_dpo` (online DPO on shapes-small) and `omni_quick` (GRPO,
full fine-tuning of the shapes Thinker). Each trains with its own recipe (algorithm, learning rate, LoRA, group size,
sampler) on a fixed pool of prompts that is also its validation set (`data.val=null`): val/reward before and after
training scores the same prompts with the same seeds, so a rise is learning, not easier prompts. What makes it cheap:
one step's worth of prompts and a few steps. The full runs' held-out gains are in docs/quickstart.md.

A warning emitted at every step breaks the console's live line (omni_quick printed DCP's "torch.distributed is
disabled" 100 times): every run here records the warnings a console would show and allows none twice.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter

import pytest
from mlflow.tracking import MlflowClient

from diffrl.configs.schema import CONFIG_DIR, load_experiment
from diffrl.flows.train import train

HELDOUT = os.path.join(os.path.dirname(CONFIG_DIR), "data", "shapes_heldout.jsonl")
# config: (overrides, the val/reward rise it must show, about half the one measured on the 2-core CPU at seed 0:
# quickstart 0.323 -> 0.545, quickstart_dpo 0.323 -> 0.483, omni_quick 0.500 -> 0.656)
SHAPES = [
    "data.train={prompts}",  # the first 6 held-out prompts (one and two objects), as a file of their own
    "data.val=null",  # validation on the training prompts, 4 samples each (seeds fixed per prompt and copy)
    "data.num_val_prompts=6",
    "data.val_samples_per_prompt=4",
    "run.steps=4",
    "run.checkpoint_every=4",
]
DEMOS = {
    "quickstart": (SHAPES, 0.1),
    "quickstart_dpo": (SHAPES, 0.08),
    "omni_quick": (
        [
            "data.num_generated=64",  # = rollout.prompts_per_step: every step trains on every question
            "data.val=null",
            "data.num_val_prompts=64",
            "run.steps=3",
            "run.checkpoint_every=3",
        ],
        0.08,
    ),
}


@pytest.mark.parametrize("config", sorted(DEMOS))
def test_the_demo_learns_and_repeats_no_warning(workdir, config):
    overrides, rise = DEMOS[config]
    with open(HELDOUT) as f:  # one step's worth of prompts (rollout.prompts_per_step: 6): each step trains on all
        (workdir / "prompts.jsonl").write_text("".join(f.readlines()[:6]))
    overrides = [o.format(prompts=workdir / "prompts.jsonl") for o in overrides]
    with warnings.catch_warnings(record=True) as caught:
        # after the filters set on purpose (DCP's, peft's), every warning is recorded each time it is emitted
        warnings.filterwarnings("always", append=True)
        result = train(config=config, overrides=overrides)
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    history = {m.step: m.value for m in client.get_metric_history(result["mlflow_run_id"], "val/reward")}
    steps = result["last_step"]
    assert sorted(history) == [0, steps], history
    assert history[steps] - history[0] >= rise, f"{config}: val/reward {history[0]:.4f} -> {history[steps]:.4f}"
    # what a console shows: Python hides DeprecationWarnings raised outside __main__
    shown = [
        str(w.message) for w in caught if not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning))
    ]
    repeated = {text: n for text, n in Counter(shown).items() if n > 1}
    assert not repeated, repeated


def test_every_shipped_cpu_config_is_a_demo_checked_here():
    """A shipped config that runs on the CPU is a demo, and a demo learns (above). Configs on tiny random-weight
    models exist for tests: they live in tests/configs (quick_nft, shipped as a demo, showed val/reward -0.0081 ->
    -0.0081)."""
    shipped = sorted(name[:-5] for name in os.listdir(CONFIG_DIR) if name.endswith(".yaml"))
    on_cpu = {name for name in shipped if load_experiment(name).model.device == "cpu"}
    assert on_cpu == {*DEMOS, "shapes_quick"}  # shapes_quick: the quickstart's recipe under other names
