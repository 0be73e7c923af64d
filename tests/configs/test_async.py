"""The `run.async` section: a Python keyword as a YAML key (file, override, printed config, doc, resume diff), its
values, the families it runs, and the one-line refusals of what asynchronous training does not run yet."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from diffrl.configs.changes import config_changes
from diffrl.configs.doc import key_docs
from diffrl.configs.loader import ConfigError, to_dict
from diffrl.configs.schema import load_experiment

ASYNC = ["run.async.max_staleness=1", "train.rollout_correction=tis"]


def test_async_section_reads_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(
        textwrap.dedent(
            """
            base: shapes_flow_grpo.yaml
            run:
              async:
                max_staleness: 1
            train:
              rollout_correction: tis
            """
        )
    )
    assert load_experiment(str(path)).run.async_.max_staleness == 1
    cfg = load_experiment("shapes_flow_grpo", ["run.async.max_staleness=2", "train.rollout_correction=mask"])
    assert cfg.run.async_.max_staleness == 2 and cfg.run.async_.enabled
    assert load_experiment("shapes_flow_grpo").run.async_.max_staleness == 0  # the synchronous step by default
    printed = yaml.safe_load(yaml.safe_dump(to_dict(cfg)))
    assert printed["run"]["async"] == {"max_staleness": 2} and "async_" not in printed["run"]


def test_async_keys_are_checked_like_any_other():
    with pytest.raises(ConfigError, match=r"did you mean 'run.async.max_staleness'"):
        load_experiment("shapes_flow_grpo", ["run.async.max_stale=1"])
    with pytest.raises(ConfigError, match=r"did you mean 'run.async'"):
        load_experiment("shapes_flow_grpo", ["run.asynch.max_staleness=1"])
    with pytest.raises(ConfigError, match=r"max_staleness must be >= 0"):
        load_experiment("shapes_flow_grpo", ["run.async.max_staleness=-1"])
    with pytest.raises(ConfigError, match=r"run.async.max_staleness: expected an integer"):
        load_experiment("shapes_flow_grpo", ["run.async.max_staleness=0.5"])


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["algorithm=awm", "train.rollout_correction='off'", "cluster.mode=ray"], "cluster.mode: local"),
        (["cluster.mode=ray", "train.offload_optimizer=true"], "train.offload_optimizer: false"),
        (["train.lora=false"], "train.lora: true"),
        (["train.rollout_correction='off'"], "train.rollout_correction to tis or mask"),
    ],
)
def test_unsupported_combinations_are_refused_in_one_line(overrides, names):
    with pytest.raises(ConfigError) as error:
        load_experiment("shapes_flow_grpo", [*ASYNC, *overrides])
    message = str(error.value)
    assert names in message and "\n" not in message and "run.async.max_staleness: 1" in message
    load_experiment("shapes_flow_grpo", ["run.async.max_staleness=0", *overrides[:1]])  # the synchronous run takes it


DP_ASYNC = ["run.async.max_staleness=1"]  # a direct-preference loss has no ratio: no rollout correction to set


@pytest.mark.parametrize("algorithm", ["dpo", "diffusion_nft", "awm"])
def test_direct_preference_runs_asynchronously_without_a_rollout_correction(algorithm):
    cfg = load_experiment("quickstart", [*DP_ASYNC, f"algorithm={algorithm}"])
    assert cfg.run.async_.enabled and cfg.train.rollout_correction == "off"
    assert cfg.algorithm.needs.data == "final_samples"


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["algorithm=dpo", "data.sample_source=offline"], "no rollout to run asynchronously"),
        (["cluster.mode=ray"], "cluster.mode: local"),
        (["train.lora=false"], "train.lora: true"),
    ],
)
def test_unsupported_direct_preference_combinations_are_refused_in_one_line(overrides, names):
    with pytest.raises(ConfigError) as error:
        load_experiment("quickstart", [*DP_ASYNC, *overrides])
    message = str(error.value)
    assert names in message and "\n" not in message and "run.async.max_staleness: 1" in message
    load_experiment("quickstart", ["run.async.max_staleness=0", *overrides])  # the synchronous run takes it


@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("correction", ["tis", "mask"])
def test_a_rollout_correction_on_a_direct_preference_loss_is_refused(staleness, correction):
    """The loss has no importance ratio: the correction would be silently ignored, synchronous or not."""
    with pytest.raises(ConfigError) as error:
        load_experiment(
            "quickstart", [f"run.async.max_staleness={staleness}", f"train.rollout_correction={correction}"]
        )
    message = str(error.value)
    assert f"{correction!r} would be ignored" in message and "train.rollout_correction: off" in message
    assert "\n" not in message


def test_token_policy_gradient_runs_asynchronously_with_the_in_process_rollout():
    cfg = load_experiment("omni_quick", [*ASYNC, "train.lora=true"])
    assert cfg.run.async_.enabled and cfg.rollout.engine == "transformers"
    load_experiment("omni_quick", [*ASYNC, "train.lora=true", "algorithm=dapo"])


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["rollout.engine=vllm"], "serialises rollout and update"),
        (["algorithm=sequence_dpo"], "pairs of tokens"),
        (["train.lora=false"], "train.lora: true"),
        (["train.rollout_correction='off'"], "train.rollout_correction to tis or mask"),
    ],
)
def test_unsupported_token_combinations_are_refused_in_one_line(overrides, names):
    with pytest.raises(ConfigError) as error:
        load_experiment("omni_quick", [*ASYNC, "train.lora=true", *overrides])
    message = str(error.value)
    assert names in message and "\n" not in message and "run.async.max_staleness: 1" in message


def test_the_refusal_of_an_algorithm_names_the_ones_that_run():
    with pytest.raises(ConfigError) as error:
        load_experiment("omni_quick", [*ASYNC, "train.lora=true", "algorithm=sequence_dpo"])
    works = str(error.value).split("runs the policy-gradient and direct-preference algorithms (")[1].split(")")[0]
    assert {"flow_grpo", "grpo", "dpo", "diffusion_nft", "awm"} <= set(works.split(", "))
    assert "sequence_dpo" not in works.split(", ")
    with pytest.raises(ConfigError, match="algorithm 'diffusion_opd' distils a teacher, which is not supported async"):
        load_experiment(None, [*ASYNC, "algorithm=diffusion_opd", "model.teacher=reference:shapes-small"])


def test_doc_and_resume_diff_name_the_yaml_key():
    doc = {d.key: d for d in key_docs()}["run.async.max_staleness"]
    assert (doc.type, doc.default, doc.allowed) == ("int", "0", ">= 0 (an integer)") and not doc.fixed
    recorded = to_dict(load_experiment("shapes_flow_grpo"))
    cfg = load_experiment("shapes_flow_grpo", ASYNC)
    changes = {c.key: c for c in config_changes(cfg, to_dict(cfg), recorded)}
    assert str(changes["run.async.max_staleness"]) == "run.async.max_staleness: 0 -> 1"
    assert not changes["run.async.max_staleness"].fixed  # a resume may turn it on or off
