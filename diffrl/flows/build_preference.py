"""What building a run adds for algorithms that train on final samples (called from diffrl/flows/build.py).

- checks that fail before any work, from the algorithm's declared needs: a diffusion model trains on denoising steps
  or final samples; for final samples the rollout window must end at the last denoising step (the trainer learns
  from the final sample); `data.sample_source: offline` needs an algorithm that trains on pairs (`algorithm: dpo`)
  or on a dataset (`algorithm: sft`);
- offline DPO: the pair prompts (without loading the images) and the VAE-latent cache, encoded once;
- SFT (`algorithm: sft`, data.sample_source offline): the (prompt, image) dataset, whose images each step encodes.
"""

from __future__ import annotations

import os

from diffrl.algorithms.catalog import algorithms
from diffrl.algorithms.windows import ends_at_last_step
from diffrl.configs.schema import ExperimentConfig
from diffrl.engines.store.image_dataset import ImageDataset
from diffrl.engines.store.preference import PreferenceCache, preference_prompts, write_toy_preferences
from diffrl.engines.store.prompts import PromptDataset
from diffrl.engines.train.trainer import TRAINED_DATA
from diffrl.models.base import SampleShape
from diffrl.shapes.scenes import write_sft_dataset


def check_preference_config(cfg: ExperimentConfig) -> None:
    """ValueError (naming the setting to change) for an algorithm setting that cannot train."""
    algo, n = cfg.algorithm, cfg.rollout.num_inference_steps
    needs = algo.needs
    if needs.data not in TRAINED_DATA:
        raise ValueError(
            f"algorithm {algo.name!r} trains on {needs.data}; a diffusion model ({cfg.model.path}) trains on "
            f"{' or '.join(TRAINED_DATA)}"
        )
    if cfg.data.sample_source == "offline" and not (needs.pairs or needs.supervised):
        pair_algorithms = " or ".join(sorted(name for name, a in algorithms().items() if a.needs.pairs))
        raise ValueError(
            f"data.sample_source 'offline' trains from (chosen, rejected) pairs and needs "
            f"algorithm: {pair_algorithms} (or from (prompt, image) rows: algorithm: {_supervised_names()}); "
            f"got algorithm {algo.name!r} (use data.sample_source: online)"
        )
    if needs.supervised:
        _check_supervised(cfg)
    if needs.data != "final_samples":
        return
    # The trainer reads the final latents: the window must end at the last step. A longer window ending there
    # makes the earlier steps stochastic too (e.g. SDE sampling throughout, as FlowGRPO's rollout does).
    window = algo.window
    if not ends_at_last_step(window, n):
        raise ValueError(
            f"algorithm {algo.name!r} trains on the final sample, so its rollout window must end at the last "
            f"denoising step: set algorithm.window to {{kind: final, size: 1}} (or {{kind: random_start, size: k, "
            f"start_range: [{n} - k, {n} - k + 1]}}; rollout.num_inference_steps is {n}); got {window}"
        )


def _supervised_names() -> str:
    return " or ".join(sorted(name for name, a in algorithms().items() if a.needs.supervised))


def _check_supervised(cfg: ExperimentConfig) -> None:
    """SFT trains on a dataset's rows, one sample each, and samples nothing."""
    name = cfg.algorithm.name
    if cfg.data.sample_source != "offline":
        raise ValueError(
            f"algorithm {name!r} trains on the (prompt, image) rows of a dataset: set data.sample_source: offline and "
            f"data.train to a .parquet or .lance path with columns prompt and image; got data.sample_source "
            f"{cfg.data.sample_source!r}"
        )
    if cfg.rollout.group_size != 1:
        raise ValueError(
            f"algorithm {name!r} trains one sample per dataset row: set rollout.group_size: 1 "
            f"(rollout.prompts_per_step rows a step); got rollout.group_size {cfg.rollout.group_size}"
        )


SHAPES_SFT_SOURCE = "generator:shapes"


def sft_source(cfg: ExperimentConfig) -> str:
    """data.train of an SFT run: a dataset path, or for `generator:shapes` rendered shapes scenes (data.num_generated
    rows at the run's resolution, drawn by run.seed) written to runs/<name>/sft_shapes_<n>x<size>px_seed<seed>.parquet
    once."""
    source = cfg.data.train
    if not source.startswith("generator:"):
        return source
    if source != SHAPES_SFT_SOURCE:
        raise ValueError(
            f"data.train {source!r}: SFT reads a .parquet or .lance dataset with columns prompt and image, or "
            f"{SHAPES_SFT_SOURCE!r} (rendered shapes scenes)"
        )
    n, size, seed = cfg.data.num_generated, cfg.rollout.height, cfg.run.seed
    path = os.path.join(cfg.run_dir, f"sft_shapes_{n}x{size}px_seed{seed}.parquet")
    if not os.path.exists(path):
        os.makedirs(cfg.run_dir, exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"  # runs sharing the folder never read a half-written file
        os.replace(write_sft_dataset(partial, n, image_size=size, seed=seed), path)
    return path


def sft_dataset(cfg: ExperimentConfig) -> ImageDataset | None:
    """The (prompt, image) dataset of an algorithm that trains on one (needs.supervised, SFT), else None."""
    if not cfg.algorithm.needs.supervised:
        return None
    return ImageDataset(sft_source(cfg), storage_options=cfg.data.storage_options or None)


TOY_SOURCE = "generator:toy_preferences"


def preference_source(cfg: ExperimentConfig) -> str:
    """The preference parquet of an offline run; `generator:toy_preferences` writes the toy set
    (data.num_generated pairs at the run's resolution) to runs/<name>/toy_preferences.parquet once."""
    source = cfg.data.train
    if not source.startswith("generator:"):
        return source
    if source != TOY_SOURCE:
        raise ValueError(f"data.train {source!r}: offline DPO reads a .parquet preference file or {TOY_SOURCE!r}")
    path = os.path.join(cfg.run_dir, "toy_preferences.parquet")
    if not os.path.exists(path):
        os.makedirs(cfg.run_dir, exist_ok=True)
        write_toy_preferences(path + ".tmp", cfg.data.num_generated, size=cfg.rollout.height, seed=cfg.run.seed)
        os.replace(path + ".tmp", path)
    return path


def train_prompts(cfg: ExperimentConfig) -> PromptDataset:
    """The pairs of an offline preference parquet as prompt records (metadata["pair"] = row)."""
    return preference_prompts(preference_source(cfg), storage_options=cfg.data.storage_options or None)


def build_preference_cache(cfg: ExperimentConfig, adapter) -> PreferenceCache:
    """runs/<name>/preferences.lance with the VAE latents of every pair (encoded only where missing)."""
    shape = SampleShape(cfg.rollout.height, cfg.rollout.width, cfg.rollout.num_frames, cfg.rollout.duration)
    cache = PreferenceCache(
        os.path.join(cfg.run_dir, "preferences.lance"), storage_options=cfg.run.storage_options or None
    )
    fingerprint = f"{adapter.fingerprint()}-{shape.height}x{shape.width}"
    cache.build(
        preference_source(cfg),
        adapter,
        shape,
        fingerprint=fingerprint,
        storage_options=cfg.data.storage_options or None,
    )
    return cache
