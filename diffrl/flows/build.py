"""Build the warm engines of a run from its config (embedded default: in-process objects)."""

from __future__ import annotations

import logging
import os
import sys

from diffrl.configs.schema import DataConfig, ExperimentConfig
from diffrl.engines import cluster
from diffrl.engines.handle import Engines
from diffrl.engines.reward.multi import MultiReward
from diffrl.engines.rollout.engine import RolloutEngine
from diffrl.engines.step.memory import StepMemory
from diffrl.engines.store import fs
from diffrl.engines.store.embeddings import EmbeddingCache
from diffrl.engines.store.prompts import PromptDataset, PromptSampler, compositional_prompts, ocr_prompts
from diffrl.engines.store.tokens import TokenStore
from diffrl.engines.store.trajectories import TrajectoryStore
from diffrl.engines.train.setup import world
from diffrl.engines.train.sync import rollout_copy, send_weights
from diffrl.engines.train.teacher import load_teacher
from diffrl.engines.train.trainer import PolicyTrainer
from diffrl.flows.build_preference import (
    build_preference_cache,
    check_preference_config,
    sft_dataset,
    train_prompts,
)
from diffrl.flows.build_tokens import build_token_model, check_token_config
from diffrl.models.base import load_adapter, set_tf32
from diffrl.models.kind import folder_kind
from diffrl.shapes.edits import shapes_edit_prompts
from diffrl.shapes.questions import HELDOUT_SEED, HELDOUT_SIZE, scene_questions
from diffrl.shapes.scenes import shapes_prompts

log = logging.getLogger("diffrl")


def cache_dir() -> str:
    """Where tiny models are built once and reused (DIFFRL_CACHE, else ~/.cache/diffrl)."""
    return os.environ.get("DIFFRL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "diffrl"))


PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE_DIR = os.path.join(PACKAGE_DIR, "models", "reference")


def resolve_model_path(path: str, *, seed: int = 0) -> str:
    """`tiny:<arch>` -> a tiny offline pipeline folder, built on first use and cached (diffrl/models/tiny.py);
    `reference:<name>` -> a model shipped in diffrl/models/reference/<name> (e.g. reference:shapes)."""
    if path.startswith("reference:"):
        name = path.split(":", 1)[1]
        folder = os.path.join(REFERENCE_DIR, name)
        if folder_kind(folder) is None:
            shipped = sorted(d for d in os.listdir(REFERENCE_DIR) if folder_kind(os.path.join(REFERENCE_DIR, d)))
            raise ValueError(f"model.path {path!r}: no shipped reference model {name!r}; shipped: {shipped}")
        return folder
    if not path.startswith("tiny:"):
        return path
    from diffrl.models.tiny import cached_tiny, tiny_architectures

    arch = path.split(":", 1)[1]
    if arch not in tiny_architectures():
        raise ValueError(
            f"model.path {path!r}: unknown tiny architecture; choose one of "
            f"{['tiny:' + a for a in tiny_architectures()]}"
        )
    return cached_tiny(arch, os.path.join(cache_dir(), "tiny"), seed=seed)


def load_prompts(source: str, data: DataConfig, *, seed: int) -> PromptDataset:
    """A prompt dataset from a file or a `generator:<name>` source."""
    if source.startswith("generator:"):
        name = source.split(":", 1)[1]
        generators = {
            "ocr": ocr_prompts,
            "compositional": compositional_prompts,
            "shapes": shapes_prompts,
            # questions about drawn scenes (diffrl/shapes/questions.py): shown as PNGs under the cache, or told
            # in words (_text); *_heldout: the fixed held-out set, whatever the run's seed
            "shapes_qa": lambda n, seed: scene_questions(n, seed, _scene_dir(seed)),
            "shapes_qa_heldout": lambda n, seed: scene_questions(HELDOUT_SIZE, HELDOUT_SEED, _scene_dir(HELDOUT_SEED)),
            "shapes_qa_text": lambda n, seed: scene_questions(n, seed, None),
            "shapes_qa_text_heldout": lambda n, seed: scene_questions(HELDOUT_SIZE, HELDOUT_SEED, None),
            # recolour instructions with their input scenes as PNGs under the cache (diffrl/shapes/edits.py)
            "shapes_edit": lambda n, seed: shapes_edit_prompts(
                n, seed, os.path.join(cache_dir(), "scenes", f"shapes_edit-seed{seed}")
            ),
        }
        if name not in generators:
            raise ValueError(
                f"data source {source!r}: unknown generator; choose one of {['generator:' + g for g in generators]}"
            )
        return generators[name](data.num_generated, seed=seed)
    return PromptDataset.load(prompt_file(source), storage_options=data.storage_options or None)


def _scene_dir(seed: int) -> str:
    return os.path.join(cache_dir(), "scenes", f"shapes_qa-seed{seed}")


def prompt_file(source: str) -> str:
    """A file as the config names it (prompts, a teacher's LoRA): the path (or URI) itself, or the file shipped with
    diffrl that a relative path names when nothing is there (data/shapes_heldout.jsonl is
    diffrl/data/shapes_heldout.jsonl)."""
    shipped = os.path.join(PACKAGE_DIR, source)
    if "://" not in source and not os.path.isabs(source) and not os.path.exists(source) and os.path.exists(shipped):
        return os.path.normpath(shipped)
    return source


def teacher_lora_file(source: str) -> str:
    """`model.teacher_lora` as a file: the path itself, or the file shipped with diffrl that a relative path names
    (prompt_file). ValueError naming every path tried when there is no such file."""
    path = prompt_file(source)
    if not os.path.isfile(path):
        tried = [os.path.abspath(source)]
        if not os.path.isabs(source):
            tried.append(os.path.normpath(os.path.join(PACKAGE_DIR, source)))
        raise ValueError(
            f"model.teacher_lora {source!r}: no such file (tried {' and '.join(tried)}); name a diffusers LoRA "
            "file such as `diffrl export RUN --out DIR` writes (DIR/pytorch_lora_weights.safetensors)"
        )
    return path


def build_engines(cfg: ExperimentConfig, actor: str = "local", *, durable: bool = True) -> Engines | cluster.RayEngines:
    """Load the model once and build the engines of the run; registered under the run name.

    `cluster.mode: ray` (called with actor="local" by the flow): the engines are built inside the run's
    named Ray actors instead (each calls back here with its actor name) and a handle is registered.
    Actors: "local" (the flow's process) and "engine" (a Ray replica) build the same engines. An "engine" that is one
    of several replicas (cluster.gpus > 1; torch.distributed is up) trains with the others: LoRA on whole parameters
    on every replica (its rollout samples with the trainer's module, as a single engine does), full fine-tuning
    sharded over them (its rollout samples with its own unsharded copy, loaded after every update). An asynchronous
    run (run.async) samples with the trainer's behaviour copy instead, on one replica or several.
    durable=False (the engines-only benchmarks): no trajectory store and no embedding cache on disk; the
    step core hands everything over in memory and writes nothing.
    """
    tokens = cfg.algorithm.needs.data == "tokens"  # an autoregressive policy: diffrl/flows/build_tokens.py
    # a setting that cannot train fails before any work
    check_token_config(cfg) if tokens else check_preference_config(cfg)
    if actor == "local" and cfg.cluster.mode == "ray":
        return _start_ray(cfg)
    pairs = cfg.data.sample_source == "offline" and not cfg.algorithm.needs.supervised  # offline DPO's latent cache
    if not durable and (cfg.cluster.mode != "local" or pairs):
        raise ValueError(
            "engines without a store (durable=False) run in one process on online rollouts or an SFT dataset: "
            "cluster.mode local, data.sample_source online (or algorithm: sft)"
        )
    needs_model = actor in ("local", "engine") and not tokens
    replica = actor == "engine" and world()[1] > 1  # one of several engine replicas (cluster.gpus > 1)
    offline = cfg.data.sample_source == "offline"
    dataset = sft_dataset(cfg)  # SFT's (prompt, image) rows; its images are read step by step
    if dataset is not None:
        train_set = dataset.prompts()
    else:
        train_set = train_prompts(cfg) if offline else load_prompts(cfg.data.train, cfg.data, seed=cfg.run.seed)
    val_source = cfg.data.val
    val_set = load_prompts(val_source, cfg.data, seed=cfg.run.seed + 10_000) if val_source else train_set
    sampler = PromptSampler(train_set, batch=cfg.rollout.prompts_per_step, seed=cfg.run.seed)
    # missing reward weights fail here, before the model loads
    reward = MultiReward(cfg.reward)
    run_dir = cfg.run_dir
    storage = cfg.run.storage_options or None
    fs.use_options(cfg.run.root, storage)  # the run's checkpoints and records, opened here (a Ray replica too)
    store_class = TokenStore if tokens else TrajectoryStore  # token rows or latent rows, the same tables otherwise
    store = store_class(os.path.join(run_dir, "trajectories.lance"), storage_options=storage) if durable else None
    adapter = rollout = trainer = preferences = None
    model_path = ""
    if tokens and actor == "local":
        model_path = resolve_model_path(cfg.model.path, seed=cfg.model.tiny_seed)
        adapter, rollout, trainer = build_token_model(cfg, model_path)
    if needs_model:
        device, dtype = cfg.model.device_and_dtype()
        model_path = resolve_model_path(cfg.model.path, seed=cfg.model.tiny_seed)
        if os.environ.get("DIFFRL_VERBOSE") != "1":  # `diffrl -v` shows diffusers' "Loading pipeline components" bar
            from diffusers.utils import logging as diffusers_logging

            diffusers_logging.disable_progress_bar()
        options = dict(cfg.model.options)  # the architecture's own knobs; an adapter refuses what it does not take
        if cfg.model.condition_area is not None:  # an editing model's option; the others refuse it
            options["condition_area"] = cfg.model.condition_area
        adapter = load_adapter(
            model_path, device=device, dtype=dtype, offload_text_encoder=cfg.model.offload_text_encoder, **options
        )
        adapter.attention = cfg.model.attention
        set_tf32(cfg.model.tf32)
        adapter.check_shape(_shape(cfg))
        embed_cache = (
            EmbeddingCache(os.path.join(run_dir, "embeddings.lance"), storage_options=storage) if durable else None
        )
        sampler_adapter = rollout_copy(adapter) if replica and not cfg.train.lora else adapter
        rollout = RolloutEngine(sampler_adapter, cache=embed_cache, progress=sys.stderr.isatty())
    if needs_model:
        teacher = None
        if cfg.model.teacher is not None:  # on-policy distillation: the teacher's frozen denoiser, asleep on the CPU
            teacher_path = resolve_model_path(cfg.model.teacher, seed=cfg.model.tiny_seed)
            lora = cfg.model.teacher_lora and teacher_lora_file(cfg.model.teacher_lora)
            teacher = load_teacher(teacher_path, adapter, lora=lora, dtype=dtype)
        trainer = PolicyTrainer(  # every diffusion algorithm: the trainer asks it what to prepare
            adapter,
            cfg.algorithm,
            cfg.train,
            cfg.sampling,
            group_size=cfg.rollout.group_size,
            device=device,
            replicate=replica and cfg.train.lora,
            behaviour=cfg.run.async_.enabled,
            teacher=teacher,
        )
        if cfg.run.async_.enabled:  # the rollout samples with its own LoRA tensors while the trainer updates
            rollout = RolloutEngine(trainer.rollout_copy, cache=embed_cache, progress=sys.stderr.isatty())
        elif rollout is not None and rollout.adapter is not adapter:  # a replica: the copy starts at the trainer's
            trainer.rollout_copy = rollout.adapter
            trainer.replayer.cache = embed_cache  # prompts another replica sampled are encoded once, in the cache
            send_weights(trainer, rollout.adapter)
        if offline and dataset is None:  # offline DPO: pairs' VAE latents, encoded once (runs/<name>/preferences.lance)
            preferences = build_preference_cache(cfg, adapter)
    if adapter is not None and cfg.model.compile and not tokens:  # after LoRA and FSDP have wrapped the blocks
        adapter.compile_blocks()
        if rollout.adapter is not adapter:
            rollout.adapter.compile_blocks()
    val_prompts = [val_set[i] for i in range(min(cfg.data.num_val_prompts, len(val_set)))]
    # The step is handed over in memory and written behind it, in the flow's process or in each Ray replica
    memory = StepMemory(asynchronous=True)
    if tokens and hasattr(rollout, "close"):  # a vLLM rollout's server ends with the run (the flow closes the memory)
        memory.close_with(rollout.close)
    engines = Engines(
        config=cfg,
        adapter=adapter,
        rollout=rollout,
        trainer=trainer,
        reward=reward,
        store=store,
        prompts=sampler,
        val_prompts=val_prompts,
        memory=memory,
        model_path=model_path,
        preferences=preferences,
        dataset=dataset,
    )
    if actor == "local":
        cluster.put(cfg.run.name, engines)
    return engines


def _start_ray(cfg: ExperimentConfig) -> cluster.RayEngines:
    """Ray mode: create-or-get the run's actors on the cluster (paths made absolute: actors have their own cwd)."""
    import dataclasses

    MultiReward(cfg.reward)  # bad reward settings fail here, before any actor starts
    if "://" not in cfg.run.root:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, root=os.path.abspath(cfg.run.root)))
    cluster.connect(cfg.cluster.address)
    if cfg.cluster.gpus == "auto":  # every GPU Ray sees; the whole config is checked again with the number
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, gpus=cluster.gpus_seen(cfg)))
        log.info("cluster.gpus: auto -> %d replicas", cfg.cluster.gpus)
    handle = cluster.start_actors(cfg, build_engines)
    handle.store = TrajectoryStore(
        os.path.join(cfg.run_dir, "trajectories.lance"), storage_options=cfg.run.storage_options or None
    )
    cluster.put(cfg.run.name, handle)
    return handle


def _shape(cfg: ExperimentConfig):
    from diffrl.models.base import SampleShape

    return SampleShape(cfg.rollout.height, cfg.rollout.width, cfg.rollout.num_frames, cfg.rollout.duration)
