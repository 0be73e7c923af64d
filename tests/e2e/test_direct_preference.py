"""The direct-preference family end to end on the tiny model: online DPO, DiffusionNFT and AWM train through
`diffrl train` and log their metrics; offline DPO learns the labels of a generated preference set
(actor/implicit_acc above 0.5) from latents VAE-encoded once; a failed update resumes without retraining.
Whether online DPO / DiffusionNFT raise the reward over a longer run is measured by benchmarks/dp_learning.py
(results in benchmarks/results/dp_learning_cpu.json)."""

from __future__ import annotations

import os

import lance
import mlflow
import pytest
from e2e_settings import TINY_SIZES, config_file
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from diffrl.configs.loader import ConfigError
from diffrl.configs.schema import load_experiment
from diffrl.engines.store.trajectories import TrajectoryStore
from diffrl.flows.build import build_engines
from diffrl.flows.train import train

LAST_STEP_WINDOW = "algorithm.window={kind: random_start, size: 1, start_range: [1, 2]}"  # TINY_SIZES has 2 steps
TINY_DP = TINY_SIZES + [LAST_STEP_WINDOW, "run.steps=2"]
OFFLINE = [
    "run.steps=4",
    "run.validate_every=0",
    "run.checkpoint_every=2",
    "run.log_images=2",
    "rollout.num_inference_steps=2",
    "rollout.height=32",
    "rollout.width=32",
    LAST_STEP_WINDOW,
    "rollout.prompts_per_step=8",
    "train.mini_batch_prompts=8",
    "train.micro_batch_size=8",
    "data.num_generated=16",
    "data.num_val_prompts=2",
]


def _history(workdir, experiment: str, key: str) -> dict[int, float]:
    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, "a resumed run must continue the same MLflow run"
    return {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, key)}


FAMILY_METRICS = {
    "quick_dpo": [
        "actor/dpo_loss",
        "actor/implicit_acc",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "dp/num_pairs",
    ],
    "quick_nft": ["actor/positive_loss", "actor/negative_loss", "actor/old_deviate", "actor/kl_loss"],
    "quick_awm": ["actor/pg_loss", "actor/fm_loss", "actor/kl_loss"],
}


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(FAMILY_METRICS))
def test_online_algorithm_trains_and_logs_its_metrics(workdir, config):
    result = train(config=config_file(config), overrides=TINY_DP)
    run_dir = f"runs/{config}"
    experiment = f"diffrl-{config.replace('_', '-')}"
    store = TrajectoryStore(os.path.join(run_dir, "trajectories.lance"))
    assert store.steps() == [0, 1] and all(store.num_rows(s) == 8 for s in (0, 1))
    for key in FAMILY_METRICS[config] + ["critic/rewards/mean", "actor/grad_norm", "timing_s/generate"]:
        assert sorted(_history(workdir, experiment, key)) == [1, 2], key
    assert result["last_step"] == 2
    if config == "quick_dpo":  # 2 prompts x 4 samples: one (best, worst) pair per group
        assert set(_history(workdir, experiment, "dp/num_pairs").values()) == {2.0}
        first = _history(workdir, experiment, "rewards/margins")[1]
        assert first == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first optimizer step
    if config == "quick_nft":  # the old adapter is checkpointed with the policy
        saved = load_file(f"{run_dir}/checkpoints/step_2/trainable.safetensors")
        assert any(".old." in k for k in saved) and any(".default." in k for k in saved)


@pytest.mark.slow
def test_offline_dpo_learns_the_labels_and_resumes_after_a_failed_update(workdir, monkeypatch):
    run_dir = "runs/quick_dpo_offline"
    monkeypatch.setenv("DIFFRL_INJECT_FAULT", "update_actor@4")
    with pytest.raises(Exception, match="injected fault"):
        train(config=config_file("quick_dpo_offline"), overrides=OFFLINE)
    assert sorted(_history(workdir, "diffrl-quick-dpo-offline", "actor/dpo_loss")) == [1, 2, 3]
    cache = lance.dataset(os.path.join(run_dir, "preferences.lance"))
    assert cache.count_rows() == 16  # every pair VAE-encoded once, at build time
    monkeypatch.delenv("DIFFRL_INJECT_FAULT")
    train(config=config_file("quick_dpo_offline"), overrides=OFFLINE)  # resumes at the failed step
    assert lance.dataset(os.path.join(run_dir, "preferences.lance")).version == cache.version  # not re-encoded
    raw = lance.dataset(os.path.join(run_dir, "trajectories.lance")).to_table(columns=["step"])
    assert sorted(raw.column("step").to_pylist()) == [s for s in range(1, 5) for _ in range(16)]  # nothing twice
    acc = _history(workdir, "diffrl-quick-dpo-offline", "actor/implicit_acc")
    # measured (seed 0, uninterrupted): [0.0, 0.625, 0.875, 0.875]; step 1 is 0 because policy == reference
    assert sorted(acc) == [1, 2, 3, 4] and acc[1] == 0.0 and acc[3] > 0.5 and acc[4] > 0.5, acc
    assert _history(workdir, "diffrl-quick-dpo-offline", "rewards/margins")[4] > 0
    store = TrajectoryStore(os.path.join(run_dir, "trajectories.lance"))
    traj = store.read_step(0, with_latents=False, with_images=False)  # step 0's latents are dropped by retention
    assert traj.sample_index.tolist() == [0, 1] * 8  # chosen, rejected of 8 pairs


@pytest.mark.parametrize(
    "config, overrides, message",
    [
        # the config's window ends at step 4 of 4: with 3 steps it no longer fits, caught at config load
        (
            "quick_dpo",
            ["rollout.num_inference_steps=3"],
            r"algorithm.window 'random_start' does not fit "
            r"rollout.num_inference_steps=3",
        ),
        ("quick_nft", ["data.sample_source=offline"], r"needs algorithm: dpo"),
        ("quick_dpo", ["data.sample_source=replay"], r"data.sample_source must be 'online' or 'offline'"),
        ("quick_dpo_offline", ["data.train=/nonexistent/prefs.parquet"], r"/nonexistent/prefs.parquet"),
    ],
)
def test_bad_direct_preference_settings_fail_before_any_work(workdir, config, overrides, message):
    # what `diffrl train` does first (without starting a Prefect flow): load the config, build the engines
    with pytest.raises((ConfigError, ValueError), match=message):
        build_engines(load_experiment(config_file(config), overrides))
    assert not os.path.exists(f"runs/{config}")
