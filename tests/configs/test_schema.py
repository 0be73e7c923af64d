"""The experiment schema: every shipped config loads; `base:` configs; algorithm bundles with overrides;
cross-field checks."""

from __future__ import annotations

import dataclasses
import os
import textwrap

import pytest

from diffrl.algorithms.catalog import get_algorithm
from diffrl.configs.loader import ConfigError, to_dict
from diffrl.configs.schema import CONFIG_DIR, load_experiment

SHIPPED = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_loads(name):
    cfg = load_experiment(name)
    assert cfg.run.name and cfg.rollout.samples_per_step >= cfg.rollout.group_size


def test_qwen_image_recipe_is_verl_omnis():
    cfg = load_experiment("qwen_image_ocr_lora")
    assert (cfg.rollout.height, cfg.rollout.num_inference_steps, cfg.rollout.guidance_scale) == (512, 10, 4.0)
    assert cfg.algorithm.noise_level == 1.2 and cfg.algorithm.clip_ratio == 1e-5
    assert (cfg.algorithm.window.kind, cfg.algorithm.window.size, cfg.algorithm.window.start_range) == (
        "random_start",
        2,
        (0, 5),
    )
    assert (cfg.rollout.group_size, cfg.rollout.prompts_per_step) == (16, 32)
    assert (cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.lr, cfg.train.mini_batch_prompts) == (
        64,
        128,
        3e-4,
        16,
    )


@pytest.mark.parametrize(
    "recipe, result",
    [("qwen_image_ocr_lora", "qwen_image_ocr_lora_h200.json"), ("sd35m_flow_grpo_ocr", "sd35m_flow_grpo_h200.json")],
)
def test_gpu_recipes_use_the_attention_backend_their_benchmark_chose(recipe, result):
    """The run takes the SDPA backend `benchmarks/rl_step.py --sdpa auto` picked for the recipe (its recorded result),
    so `diffrl train` trains with the kernels the per-GPU figure was measured with."""
    import json

    path = os.path.join(os.path.dirname(CONFIG_DIR), "..", "benchmarks", "results", result)
    with open(path) as f:
        measured = json.load(f)
    assert "--sdpa auto" in measured["command"]
    assert load_experiment(recipe).model.attention == measured["main"]["levers"]["sdpa"] == "cudnn"


def test_algorithm_bundle_with_overrides():
    cfg = load_experiment(None, ["algorithm=mix_grpo", "algorithm.window.size=2", "algorithm.kl_coef=0.01"])
    assert cfg.algorithm.name == "mix_grpo" and cfg.algorithm.kl_coef == 0.01
    assert cfg.algorithm.window.kind == "mix_progressive" and cfg.algorithm.window.size == 2
    # the algorithm's stochastic parts reach the sampler
    assert cfg.sampling.sde_type == cfg.algorithm.sde_type and cfg.sampling.window == cfg.algorithm.window


def test_algorithm_override_replaces_the_section_and_a_field_override_edits_it():
    """The quickstart sets DiffusionNFT fields (a 4-step window, an old-policy EMA, noise 0.5). `algorithm=NAME`
    starts from NAME's bundle and keeps none of them; `algorithm.name=NAME` renames and keeps them, so NAME must
    have them (flow_grpo has no reference penalty: an error, not a setting nobody reads)."""
    quick = load_experiment(None).algorithm
    assert (quick.name, quick.window.size, quick.old_policy_decay_max) == ("diffusion_nft", 4, 0.8)
    fresh = load_experiment(None, ["algorithm=flow_grpo"]).algorithm
    assert fresh == get_algorithm("flow_grpo")
    with pytest.raises(ConfigError, match=r"unknown Algorithm field\(s\) \['ref_coef'\] for 'flow_grpo'"):
        load_experiment(None, ["algorithm.name=flow_grpo"])
    grpo = load_experiment("shapes_flow_grpo_10step").algorithm
    renamed = load_experiment("shapes_flow_grpo_10step", ["algorithm.name=flow_grpo_fast"]).algorithm
    assert renamed.name == "flow_grpo_fast" and (renamed.kl_coef, renamed.clip_ratio) == (grpo.kl_coef, grpo.clip_ratio)
    mapped = load_experiment(None, ["algorithm={name: grpo_guard, kl_coef: 0.0}", "algorithm.clip_ratio=0.1"]).algorithm
    assert mapped == get_algorithm("grpo_guard", kl_coef=0.0, clip_ratio=0.1)
    for bad in ("algorithm=3", "algorithm=", "algorithm=[flow_grpo]"):
        with pytest.raises(ConfigError, match="takes an algorithm name or a mapping"):
            load_experiment(None, [bad])


def test_quickstart_is_shapes_quick_under_its_own_names():
    """diffrl/configs/quickstart.yaml is `base: shapes_quick.yaml` plus the run's names: the same recipe."""
    quick, shapes = to_dict(load_experiment(None)), to_dict(load_experiment("shapes_quick"))
    assert (quick["run"].pop("name"), quick["run"].pop("experiment")) == ("quickstart", "diffrl-quickstart")
    assert (shapes["run"].pop("name"), shapes["run"].pop("experiment")) == ("shapes-quick", "diffrl-shapes")
    assert quick == shapes


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_base_config_merges_sections_key_by_key(tmp_path):
    """A config's `base:` (a file beside it, else a shipped name) loads first; mappings merge key by key, a base
    may have its own base, and an algorithm mapping naming another algorithm replaces the base's section."""
    _write(
        tmp_path / "mid.yaml",
        """\
        base: shapes_quick
        train: {lr: 1.0e-4}
        """,
    )
    child = _write(
        tmp_path / "child.yaml",
        """\
        base: mid.yaml
        run: {name: child}
        rollout: {num_inference_steps: 6}
        """,
    )
    cfg, shapes = load_experiment(child), load_experiment("shapes_quick")
    assert (cfg.run.name, cfg.run.steps, cfg.run.experiment) == ("child", shapes.run.steps, shapes.run.experiment)
    assert (cfg.train.lr, cfg.train.lora_rank) == (1e-4, shapes.train.lora_rank)
    assert (cfg.rollout.num_inference_steps, cfg.rollout.group_size) == (6, shapes.rollout.group_size)
    assert cfg.algorithm == shapes.algorithm
    edited = _write(tmp_path / "edited.yaml", "base: shapes_quick\nalgorithm: {noise_level: 0.9}\n")
    assert load_experiment(edited).algorithm == dataclasses.replace(shapes.algorithm, noise_level=0.9)
    other = _write(tmp_path / "other.yaml", "base: shapes_quick\nalgorithm: {name: flow_grpo, kl_coef: 0.0}\n")
    assert load_experiment(other).algorithm == get_algorithm("flow_grpo", kl_coef=0.0)
    assert load_experiment(other, ["run.steps=3"]).run.steps == 3  # overrides apply after the merge


def test_bad_base_configs_are_config_errors(tmp_path):
    loop_a = _write(tmp_path / "a.yaml", "base: b.yaml\n")
    _write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="forms a cycle"):
        load_experiment(loop_a)
    with pytest.raises(ConfigError, match="neither a file nor a shipped config"):
        load_experiment(_write(tmp_path / "missing.yaml", "base: no_such_config\n"))
    with pytest.raises(ConfigError, match="`base:` must name a config"):
        load_experiment(_write(tmp_path / "list.yaml", "base: [shapes_quick]\n"))


def test_scientific_notation_without_a_dot_is_a_number_everywhere():
    """YAML 1.1 (PyYAML) reads `1e-4` as a string; typed fields, the algorithm's included, take it as a float."""
    cfg = load_experiment(None, ["algorithm.ref_coef=1e-4", "algorithm.mix_beta=4e-2", "train.lr=3e-4"])
    assert (cfg.algorithm.ref_coef, cfg.algorithm.mix_beta, cfg.train.lr) == (1e-4, 0.04, 3e-4)
    assert isinstance(cfg.algorithm.ref_coef, float)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.mix_beta=tiny"], r"algorithm.mix_beta: expected a number, got 'tiny'"),
        (["model.attention=sage"], r"model.attention must be one of default, cudnn, flash, efficient, math"),
        (["algorithm.name=flow_grpoo"], r"unknown algorithm 'flow_grpoo'"),
        (["algorithm.clip_ratoi=0.1"], r"unknown Algorithm field"),
        (["rollout.same_noise_per_group=true", "rollout.chunk_size=4"], r"whole groups per chunk"),
        (["train.mini_batch_prompts=64"], r"exceeds rollout.prompts_per_step"),
        (["rollout.chunk_size=3"], r"multiple or a divisor"),
        (["model.dtype=fp8"], r"model.dtype must be one of"),
        (["cluster.mode=k8s"], r"cluster.mode must be"),
        (
            ["rollout.num_inference_steps=3"],
            r"algorithm.window 'random_start' does not fit rollout.num_inference_steps=3",
        ),
        (["data.val_samples_per_prompt=0"], r"data.val_samples_per_prompt must be >= 1, got 0"),
        # root/name: "." wrote the run into the working directory itself, ".." above it
        (["run.name=."], r"run.name must be a plain folder name \(not '.' or '..', no '/' or '\\'\), got '\.'"),
        (["run.name=.."], r"run.name must be a plain folder name .*got '\.\.'"),
        (["run.name=a/b"], r"run.name must be a plain folder name .*got 'a/b'"),
        (["run.name=a\\b"], r"run.name must be a plain folder name .*got 'a\\\\b'"),
    ],
)
def test_bad_values_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_experiment(None, overrides)


def test_keep_latents_steps_takes_a_count_or_minus_one():
    assert load_experiment(None, []).run.keep_latents_steps == 2
    assert load_experiment(None, ["run.keep_latents_steps=-1"]).run.keep_latents_steps == -1
    with pytest.raises(ConfigError, match=r"run.keep_latents_steps must be >= 0 .* or -1 .*got -2"):
        load_experiment(None, ["run.keep_latents_steps=-2"])


def test_config_list_prints_each_shipped_config_with_its_one_line_summary(capsys):
    from diffrl.flows.cli import main

    assert main(["config", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    shipped = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))
    assert [line.split()[0] for line in lines] == shipped
    for line, name in zip(lines, shipped):
        summary = line[len(name) :].strip()
        assert 10 <= len(summary) <= 100, f"{name}.yaml needs a one-line summary as its first line: {summary!r}"


def test_a_reward_gate_needs_its_main_component_and_another_when_the_config_loads():
    """GARDO's KL gate ranks `main_reward` against the other reward components: checked before any rollout."""
    gate = "algorithm={name: gardo, kl_gate_fraction: 0.1, main_reward: ocr}"
    with pytest.raises((ConfigError, ValueError), match="main_reward 'ocr' must be one of the reward components"):
        load_experiment(None, [gate])
    two = "reward.components=[{name: ocr, weight: 0.8}, {name: aesthetic, weight: 0.2}]"
    assert load_experiment(None, [gate, two]).algorithm.needs.reward_gate


def test_a_teacher_goes_with_an_algorithm_that_distils_one():
    cfg = load_experiment(None, ["algorithm=diffusion_opd", "model.teacher=reference:shapes-small"])
    assert cfg.algorithm.needs.teacher and cfg.model.teacher == "reference:shapes-small"
    for overrides in (["algorithm=diffusion_opd"], ["model.teacher=reference:shapes-small"]):
        with pytest.raises(ValueError, match="model.teacher must be set exactly when the algorithm distils a teacher"):
            load_experiment(None, overrides)
    with pytest.raises(ValueError, match="model.teacher_lora is fused into model.teacher: set model.teacher too"):
        load_experiment(None, ["model.teacher_lora=teacher.safetensors"])
