"""FSDP2 on CPU/gloo: 2 processes give the same losses and updated weights as 1 process (<= 1e-5 in fp32; in bf16
within bf16 rounding, below).

In fp32, and over a bf16 base model: LoRA weights stay fp32 and compute in fp32 on any world size
(cast to bf16 by FSDP's mixed-precision policy, the 2-process weights differ by 19 % of the update, 40x what
reordering the bf16 sums alone gives).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

WORKER = os.path.join(os.path.dirname(__file__), "fsdp_worker.py")
DTYPES = ("fp32", "bf16")


def _run(args: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow
def test_two_process_fsdp2_matches_one_process(tiny_model, tmp_path):
    """fp32 and bf16 one after the other in the same processes: one start-up of the interpreters and of torchrun."""
    path = tiny_model("sd3")
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    _run([sys.executable, WORKER, path, str(one), "cpu", ",".join(DTYPES)])
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            WORKER,
            path,
            str(two),
            "cpu",
            ",".join(DTYPES),
        ]
    )
    for dtype in DTYPES:
        _assert_two_processes_match(one / dtype, two / dtype, dtype)


def _assert_two_processes_match(one, two, dtype: str) -> None:
    w1, w2 = load_file(str(one / "weights.safetensors")), load_file(str(two / "weights.safetensors"))
    assert w1.keys() == w2.keys() and len(w1) > 0
    moved = max(float(w1[name].abs().max()) for name in w1 if "lora_B" in name)
    assert moved > 1e-3  # the weights really changed (LoRA B starts at 0)
    gap = max(float((w2[name] - w1[name]).abs().max()) for name in w1)
    print(f"\n{dtype}: largest LoRA B {moved:.3e}, largest 2-process gap {gap:.3e} ({gap / moved:.2%} of it)")
    if dtype == "fp32":
        assert gap <= 1e-5
    else:
        # bf16 sums in another order over 2 ranks (each rank's half batch): within 1e-5 on the earlier 2-core CI
        # machines, 6.2 % of the update on an AMD EPYC one (2.5e-3 of 4.0e-2); the mixed-precision bug above: 19 %
        assert gap <= 0.1 * moved
    m1, m2 = json.loads((one / "metrics.json").read_text()), json.loads((two / "metrics.json").read_text())
    # bf16 (8 mantissa bits, eps 2^-8 = 3.9e-3): a bf16 base model's forward on another batch split differs by a few
    # of its ulps (pg_loss -3.13e-4 against -4.20e-4 on the AMD EPYC machine), fp32 by float rounding
    tolerance = 1e-5 if dtype == "fp32" else 2e-3
    for step1, step2 in zip(m1, m2):
        for name in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ratio_mean"):
            gap = abs(step1[name] - step2[name])
            assert gap <= tolerance * max(1.0, abs(step1[name])), (name, step1[name], step2[name])


@pytest.mark.slow
def test_a_two_process_lora_checkpoint_resumes_exactly(tiny_model, tmp_path):
    """Sharded (cluster.trainers) and replicated (engine replicas) LoRA trainers: a checkpoint loads back the same
    weights and optimizer state on every rank, and the next update is the one the original trainer makes (a rank that
    loaded only its own copy of the full state would keep its initial weights)."""
    worker = os.path.join(os.path.dirname(__file__), "fsdp_resume_worker.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _run([*torchrun, worker, tiny_model("sd3"), str(tmp_path)])
    report = json.loads((tmp_path / "resume.json").read_text())
    for mode in ("sharded", "replicated"):
        r = report[mode]
        assert r["weights_gap"] == 0.0 and r["optimizer_gap"] == 0.0 and r["finite"], (mode, r)
        assert r["grad_norms"][1] == pytest.approx(r["grad_norms"][0], rel=1e-6), (mode, r)
