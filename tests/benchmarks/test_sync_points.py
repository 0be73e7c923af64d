"""benchmarks/sync_points.py: synchronising calls counted per step by stage and call site, from hand-made stacks, and
its capture of the warnings (no CUDA on CI: torch's sync-debug warning is emitted here by `warnings.warn` with the same
message, on the main thread and on a worker thread, as the run-ahead worker runs stages)."""

from __future__ import annotations

import threading
import warnings

import pytest

from benchmarks import sync_points as sp

VENV = "/x/.venv/lib/python3.11/site-packages"
BACKWARD = (
    ("/x/benchmarks/rl_step.py", 300, "step"),
    ("/x/diffrl/engines/train/trainer.py", 270, "_steps_mini_batch"),
    ("/x/diffrl/algorithms/sde.py", 197, "sde_step"),
    (f"{VENV}/torch/_tensor.py", 40, "__bool__"),
)
DIFFUSERS = (
    ("/x/diffrl/models/qwen_image/adapter.py", 205, "velocity"),
    (f"{VENV}/diffusers/models/transformers/transformer_qwenimage.py", 934, "forward"),
    (f"{VENV}/torch/nn/modules/module.py", 1700, "_call_impl"),
)


def test_call_sites_name_the_caller_outside_torch_and_the_line_diffrl_can_change():
    assert sp.call_sites(BACKWARD) == (
        "diffrl/algorithms/sde.py:197 (sde_step)",
        "diffrl/algorithms/sde.py:197 (sde_step)",
    )
    assert sp.call_sites(DIFFUSERS) == (
        "diffusers/models/transformers/transformer_qwenimage.py:934 (forward)",
        "diffrl/models/qwen_image/adapter.py:205 (velocity)",
    )
    assert sp.call_sites(((f"{VENV}/torch/x.py", 1, "f"),)) == ("-", "-")


def test_summarize_counts_per_step_by_stage_and_site():
    records = [sp.SyncRecord("update_actor", BACKWARD)] * 6 + [sp.SyncRecord("generate", DIFFUSERS)] * 2
    summary = sp.summarize(records, steps=2)
    assert summary["syncs_per_step"] == 4.0
    assert summary["by_stage_per_step"] == {"generate": 1.0, "update_actor": 3.0}
    assert summary["sites"][0] == {
        "stage": "update_actor",
        "site": "diffrl/algorithms/sde.py:197 (sde_step)",
        "diffrl_site": "diffrl/algorithms/sde.py:197 (sde_step)",
        "per_step": 3.0,
    }
    assert summary["sites"][1]["per_step"] == 1.0 and summary["sites"][1]["stage"] == "generate"
    assert "4 a step (generate 1, update_actor 3)" in sp.format_summary(summary)
    assert sp.summarize([], steps=1)["syncs_per_step"] == 0
    with pytest.raises(ValueError, match="steps"):
        sp.summarize(records, steps=0)


def test_capturing_keeps_each_sync_warning_with_its_stage_on_every_thread():
    def generate():
        warnings.warn(sp.MESSAGE + " (a fake: no CUDA here)", UserWarning)

    def update_actor():
        for _ in range(2):  # the same line twice: both kept ("always")
            warnings.warn(sp.MESSAGE, UserWarning)

    stages = {"generate": (generate, object), "update_actor": (update_actor, object)}
    records: list[sp.SyncRecord] = []
    with sp.capturing(stages, records):
        worker = threading.Thread(target=lambda: stages["generate"][0]())
        worker.start()
        worker.join()
        stages["update_actor"][0]()
        warnings.warn(sp.MESSAGE, UserWarning)  # between stages
        with pytest.warns(UserWarning, match="unrelated"):  # other warnings are still shown
            warnings.warn("unrelated", UserWarning)
    assert sorted(r.stage for r in records) == ["generate", "outside", "update_actor", "update_actor"]
    assert stages["generate"][0] is generate and stages["update_actor"][0] is update_actor  # the table restored
    generate_site, ours = sp.call_sites(next(r for r in records if r.stage == "generate").frames)
    assert generate_site.endswith("(generate)") and ours == "-"  # a test file is neither diffrl/ nor benchmarks/
