"""GPU RL-step benchmark: images/GPU/s of a whole policy-gradient step at real model size.

Builds the recipe's run config (`experiment_config`) and its engines as `diffrl train` builds them (`build_engines(cfg,
durable=False)`, diffrl/flows/build.py) on `model.path: random:<folder>`, the published configs with random weights at
real size on the device (benchmarks/common.py: real transformer and VAE; no text encoder -- random prompt embeddings of
the real shapes are read through the engine's persistent embedding-cache path, as a run reads cached prompts), then
runs `--warmup` + `--steps` RL
steps through the step core the `rl_step` flow runs (diffrl/engines/step/run.py run_step, stages called directly, no
trajectory store): generate (rollout, VAE decode) -> score (jpeg_compressibility, a CPU rule reward streamed
behind the rollout) -> advantages -> update_actor (replay + loss + backward + optimizer steps) -> sync_weights.

images/GPU/s = images per step / (seconds per step x GPUs), a step's seconds being the time from the end of one
step to the end of the next, as a run sees it (the reward included; text encoding excluded).
Before the steps, probes time
single forwards/backwards (CFG batching, SDPA backends, micro-batch x activation checkpointing, VAE decode,
FLOPs per forward); `auto` levers are set from them. After the main measurement, variants change one
lever each (old-log-prob recompute, full checkpointing, no KL, torch.compile) and are timed the same way.

MFU counts model FLOPs (torch.utils.flop_counter on one conditional forward of one image):
per image and step, rollout N x c x F, training T x c x 2F (LoRA: forward + input-gradient backward),
reference T x c x F when KL > 0, old-log-prob recompute T x c x F when on, plus one VAE decode; c = 2
with CFG. Checkpointing recompute is not counted (it is overhead, not model work).

    python -m benchmarks.rl_step --recipe qwen_image_ocr_lora --quick      # GPU -> benchmarks/results/...json
    python -m benchmarks.rl_step --recipe sd35m_flow_grpo --tiny --device cpu --out /tmp/x.json  # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from benchmarks import common, kernel_profile, sync_points
from diffrl.algorithms.catalog import Algorithm, get_algorithm
from diffrl.configs.reward import RewardComponent, RewardConfig
from diffrl.configs.rollout import OdeShortcut, RolloutWeights
from diffrl.configs.schema import DataConfig, ExperimentConfig, ModelConfig, RolloutConfig, RunConfig
from diffrl.configs.train import TrainConfig
from diffrl.engines.step.run import DirectStages, StepClock, run_step
from diffrl.engines.train.setup import apply_lora_compute
from diffrl.flows.build import build_engines
from diffrl.models.base import SampleShape, pad_and_cat, set_tf32
from diffrl.models.kind import RANDOM

DATASHEET_TFLOPS = 989.4  # H100/H200 SXM dense bf16 (datasheet); the measured matmul rate is recorded too
PUBLISHED = {
    "qwen_image_ocr_lora": {"verl_omni_4xH800": 0.305},
    "sd35m_flow_grpo": {"flow_grpo_reference": 1.1},
    "sd35m_mix_grpo": {},
}


@dataclass(frozen=True)
class Recipe:
    """One published training recipe (what the step does); the levers say how fast it runs."""

    arch: str
    algorithm: Algorithm
    guidance_scale: float
    negative_prompt: str
    group_size: int
    prompts_per_step: int
    mini_batch_prompts: int
    lora_rank: int
    lora_alpha: int
    text_tokens: int  # tokens of a prompt's embedding (after the template drop)
    negative_tokens: int
    rollout_batch: int
    train_candidates: tuple  # (checkpointing fraction, micro-batch) pairs the probes try
    resolution: int = 512
    num_inference_steps: int = 10
    lr: float = 3e-4
    ode_tail: str = "off"  # the recipe config's rollout.ode_tail (SOLVER:EVALUATIONS), the main levers' default
    sort_by_window: bool = False  # the recipe config's rollout.sort_by_window, the main levers' default


RECIPES = {
    # VeRL-Omni run_qwen_image_ocr_lora: true CFG 4 with negative " ", noise 1.2, a 2-step SDE window
    # starting in [0, 5), group 16, 32 prompts (512 images), one optimizer step per 16 prompts,
    # LoRA r64/a128 on the 12 attention + MLP projections, lr 3e-4, clip 1e-5.
    "qwen_image_ocr_lora": Recipe(
        arch="qwen_image",
        guidance_scale=4.0,
        negative_prompt=" ",
        group_size=16,
        prompts_per_step=32,
        mini_batch_prompts=16,
        lora_rank=64,
        lora_alpha=128,
        text_tokens=32,
        negative_tokens=6,
        rollout_batch=16,
        algorithm=get_algorithm("flow_grpo_fast", noise_level=1.2, window={"start_range": (0, 5)}, clip_ratio=1e-5),
        ode_tail="ab2:2",  # as diffrl/configs/qwen_image_ocr_lora.yaml sets it (its guard passed)
        sort_by_window=True,  # the same (its own guard passed); saves only when a call holds several forward batches
        train_candidates=((1.0, 4), (1.0, 8), (0.5, 4), (0.0, 1), (0.0, 2), (0.0, 4)),
    ),
    # flow_grpo SD3.5-Medium: CFG 4.5, noise 0.7, group 24, LoRA r32/a64, 9 trained steps, KL 0.04; prompts
    # and the empty negative encoded with max_sequence_length=128 (scripts/train_sd3.py): 77 CLIP + 128 T5 tokens.
    "sd35m_flow_grpo": Recipe(
        arch="sd3",
        guidance_scale=4.5,
        negative_prompt="",
        group_size=24,
        prompts_per_step=48,
        mini_batch_prompts=24,
        lora_rank=32,
        lora_alpha=64,
        text_tokens=77 + 128,
        negative_tokens=77 + 128,
        rollout_batch=24,
        algorithm=get_algorithm("flow_grpo"),
        train_candidates=((1.0, 12), (0.0, 4), (0.0, 8), (0.0, 12), (0.0, 24), (0.5, 24)),
    ),
}
# diffrl/configs/sd35m_mix_grpo_ocr.yaml at the flow_grpo recipe's batch: MixGRPO (dance SDE, progressive 4-step window
# starting at 0 for RL steps 1-25), the rest as sd35m_flow_grpo; the ODE-tail lever's best case (6 deterministic steps
# after the window).
RECIPES["sd35m_mix_grpo"] = dataclasses.replace(
    RECIPES["sd35m_flow_grpo"], algorithm=get_algorithm("mix_grpo"), train_candidates=((0.0, 12), (0.0, 24))
)
VARIANTS = {  # name -> lever overrides of the main measurement (one "before" state each)
    "recompute_old_log_probs": {"old_log_probs": "recompute"},
    "full_checkpointing": {"checkpointing": 1.0},
    "no_kl": {"kl": False},
    "sdpa_default": {"sdpa": "default"},
    "tf32": {"tf32": True},
    "no_tf32": {"tf32": False},
    "lora_base": {"lora_compute": "base"},
    "lora_fp32": {"lora_compute": "fp32"},
    # the deterministic steps after each chunk's last SDE window on fewer evaluations (rollout.ode_tail)
    "ode_tail_dpm2m_3": {"ode_tail": "dpm2m:3"},
    "ode_tail_ab2_2": {"ode_tail": "ab2:2"},
    # the deterministic steps before each forward batch's first SDE window on one Euler evaluation
    "ode_head_euler_1": {"ode_head": "euler:1"},
    # the rollout's forwards on a merged-LoRA / FP8 copy of the weights (rollout.weights)
    "weights_merged": {"weights": "merged"},
    "weights_fp8": {"weights": "fp8"},
    "weights_fp8_deterministic": {"weights": "fp8:deterministic"},
    # forward batches of rows sorted by window start (rollout.sort_by_window; saves with an ODE tail on)
    "sort_by_window": {"sort_by_window": True},
    "unsorted": {"sort_by_window": False},
    "compile": {"compile": True},  # last: compilation cannot be undone
}
ROLLOUT_LEVERS = frozenset({"ode_tail", "ode_head", "weights", "sort_by_window"})  # Levers fields the sampler reads


@dataclass(frozen=True)
class Levers:
    rollout_batch: int
    micro_batch: int
    checkpointing: float
    sdpa: str = "default"
    compile: bool = False
    old_log_probs: str = "auto"
    kl: bool = True
    tf32: bool = False
    lora_compute: str = "fp32"
    ode_tail: str = "off"  # rollout.ode_tail as SOLVER:EVALUATIONS (dpm2m:3, ab2:2) or off
    ode_head: str = "off"  # rollout.ode_head, the same form
    weights: str = "lora"  # rollout.weights as KIND or KIND:STEPS (merged, fp8, fp8:deterministic)
    sort_by_window: bool = False  # rollout.sort_by_window


def ode_shortcut(text: str) -> OdeShortcut:
    """`off` or `SOLVER:EVALUATIONS` (e.g. dpm2m:3) -> the rollout's OdeShortcut."""
    if text == "off":
        return OdeShortcut()
    solver, _, evaluations = text.partition(":")
    if not evaluations.isdigit():
        raise ValueError(f"an ODE shortcut is off or SOLVER:EVALUATIONS (dpm2m:3); got {text!r}")
    return OdeShortcut(solver, int(evaluations))


def rollout_weights(text: str) -> RolloutWeights:
    """`KIND` or `KIND:STEPS` (e.g. fp8:deterministic) -> the rollout's RolloutWeights (steps default: all)."""
    kind, _, steps = text.partition(":")
    return RolloutWeights(kind, steps or "all")


def experiment_config(recipe: Recipe, args, *, model_path: str, root: str) -> ExperimentConfig:
    """The run config of the recipe at the benchmark's size: what `diffrl train` would read from a YAML file."""
    return ExperimentConfig(
        run=RunConfig(name=f"bench-{args.recipe}", root=root, steps=10**6, validate_every=0, log_images=0),
        model=ModelConfig(path=model_path, device=args.device, tf32=args.tf32),  # dtype auto: bf16 on CUDA
        algorithm=recipe.algorithm,
        train=TrainConfig(
            lora_rank=recipe.lora_rank,
            lora_alpha=recipe.lora_alpha,
            lr=recipe.lr,
            mini_batch_prompts=recipe.mini_batch_prompts,
            micro_batch_size=4,
            lora_compute=args.lora_compute,
        ),
        rollout=RolloutConfig(
            num_inference_steps=recipe.num_inference_steps,
            height=recipe.resolution,
            width=recipe.resolution,
            guidance_scale=recipe.guidance_scale,
            negative_prompt=recipe.negative_prompt,
            batch_size=recipe.rollout_batch,
            group_size=recipe.group_size,
            prompts_per_step=recipe.prompts_per_step,
            chunk_size=recipe.prompts_per_step * recipe.group_size,
        ),
        reward=RewardConfig(components=[RewardComponent(name="jpeg_compressibility")]),
        data=DataConfig(val=None, num_val_prompts=0),
    )


class Bench:
    """Owns the engines of one benchmark run, built as a run builds them (`build_engines(cfg, durable=False)`: the step
    core's engines without a store), and applies levers between phases."""

    def __init__(self, recipe: Recipe, args, workdir: str):
        self.recipe, self.args, self.device = recipe, args, args.device
        folder = common.random_model_folder(recipe.arch, os.path.join(workdir, "model"), tiny=args.tiny)
        self.config = experiment_config(recipe, args, model_path=RANDOM + folder, root=workdir)
        self.engines = build_engines(self.config, durable=False)
        self.adapter, self.engine, self.trainer = self.engines.adapter, self.engines.rollout, self.engines.trainer
        # the text side: random encodings of the real shapes, read through the rollout's persistent-cache path as a
        # run reads its cached prompts (no text encoder is built)
        negative = {recipe.negative_prompt: recipe.negative_tokens}
        self.embeddings = common.RandomEmbeddings(self.adapter, recipe.text_tokens, negative)
        self.engine.cache = self.embeddings
        self.prompts = [f"prompt {i}" for i in range(recipe.prompts_per_step)]  # the probes' inputs
        self.stages = DirectStages(self.engines)
        self.compiled = False

    @property
    def shape(self) -> SampleShape:
        return SampleShape(self.recipe.resolution, self.recipe.resolution)

    def apply(self, levers: Levers) -> None:
        """Set the levers on the engines (trainer config fields are read at every update)."""
        self.engines.memory.drain()  # nothing of the last phase (a prefetched rollout) runs past this point
        self.engines.memory.release_before(10**9)
        algorithm = dataclasses.replace(
            self.recipe.algorithm, kl_coef=self.recipe.algorithm.kl_coef if levers.kl else 0.0
        )
        self.config = dataclasses.replace(
            self.config,
            algorithm=algorithm,
            rollout=dataclasses.replace(
                self.config.rollout,
                batch_size=levers.rollout_batch,
                ode_tail=ode_shortcut(levers.ode_tail),
                ode_head=ode_shortcut(levers.ode_head),
                sort_by_window=levers.sort_by_window,
                weights=rollout_weights(levers.weights),
            ),
        )
        self.engines.config = self.config
        # the trainer reads rollout.weights from its sampling config (whether the rollout's log-probs are its own)
        self.trainer.sampling = self.config.sampling
        self.trainer.cfg.micro_batch_size = levers.micro_batch
        self.trainer.cfg.old_log_probs = levers.old_log_probs
        self.trainer.algorithm = algorithm
        self.adapter.attention = levers.sdpa  # what `model.attention` sets: the denoiser forwards prefer it
        set_tf32(levers.tf32)  # what `model.tf32` sets
        apply_lora_compute(self.adapter.transformer, levers.lora_compute)  # what `train.lora_compute` sets
        common.set_checkpointing(self.adapter.transformer, levers.checkpointing)
        if levers.compile and not self.compiled:
            self.adapter.compile_blocks()
            self.compiled = True

    def step(self, step: int, clock: StepClock) -> dict[str, float]:
        """One RL step through the step core; its seconds as a run sees them and the stage seconds."""
        metrics = run_step(self.engines, step, self.stages).metrics
        seconds = clock.lap()
        return {
            "step": seconds,
            "rollout": metrics["timing_s/generate"],
            "rollout_wait": metrics["timing_s/generate_wait"],
            "reward": metrics["timing_s/reward"],
            "reward_wait": metrics["timing_s/reward_wait"],
            "update": metrics["timing_s/update_actor"],
            "sync": metrics["timing_s/sync_weights"],
            "logprob_gap": metrics.get("rollout_corr/logprob_abs_diff_mean", float("nan")),
        }


# ---- probes ----------------------------------------------------------------------------------------
def _inputs(bench: Bench, batch: int):
    """(latents, sigma, positive, negative) for `batch` samples at the recipe's second sigma."""
    adapter, shape = bench.adapter, bench.shape
    latents = adapter.prepare_latents(shape, [torch.Generator().manual_seed(i) for i in range(batch)])
    sigma = adapter.sigmas(bench.recipe.num_inference_steps, shape)[1].expand(batch).to(bench.device)
    prompts = [bench.prompts[i % len(bench.prompts)] for i in range(batch)]
    positive = pad_and_cat([bench.embeddings.encoding(p) for p in prompts])
    negative = pad_and_cat([bench.embeddings.encoding(bench.recipe.negative_prompt)] * batch)
    return latents.to(bench.device), sigma, positive, negative


def _rows(enc, n):
    return {k: v[:n] for k, v in enc.items()}


def probe_forwards(bench: Bench) -> dict:
    """Rollout forward (CFG batched vs two forwards) per SDPA backend, VAE decode and FLOPs, per image."""
    a, g, shape, dev = bench.adapter, bench.recipe.guidance_scale, bench.shape, bench.device
    b = bench.recipe.rollout_batch
    x, sigma, pos, neg = _inputs(bench, b)
    reps = dict(repeats=3, warmup=1, device=dev)
    out: dict = {"rollout_batch": b}
    with torch.no_grad():

        def batched():
            return a.velocity(x, sigma, pos, neg, guidance_scale=g, shape=shape)

        def two_forwards():
            a.velocity(x, sigma, pos, None, guidance_scale=1.0, shape=shape)
            a.velocity(x, sigma, neg, None, guidance_scale=1.0, shape=shape)

        out["cfg_two_forwards_ms_per_image"] = 1e3 * common.time_median(two_forwards, **reps) / b
        out["sdpa_ms_per_image"] = {}
        for name in common.SDPA_BACKENDS[:4]:  # math materialises the attention matrix: never the fastest
            try:
                with common.sdpa_backend(name):
                    out["sdpa_ms_per_image"][name] = 1e3 * common.time_median(batched, **reps) / b
            except RuntimeError as err:  # a backend that does not support these inputs (e.g. a mask)
                out["sdpa_ms_per_image"][name] = f"unsupported: {str(err).splitlines()[0][:160]}"
        out["cfg_batched_ms_per_image"] = out["sdpa_ms_per_image"]["default"]
        latents_b = x[:b]
        out["decode_ms_per_image"] = 1e3 * common.time_median(lambda: a.decode(latents_b, shape), **reps) / b
        out["forward_flops"] = common.forward_flops(
            lambda: a.velocity(x[:1], sigma[:1], _rows(pos, 1), None, guidance_scale=1.0, shape=shape)
        )
        out["decode_flops"] = common.forward_flops(lambda: a.decode(x[:1], shape))
    return out


def probe_training(bench: Bench, sdpa_names: list[str]) -> dict:
    """Replay-style forward + backward (CFG, LoRA) per image for each (checkpointing, micro-batch) candidate
    and, at the fastest candidate that fits, per SDPA backend; OOM is recorded, not raised."""
    cands = bench.recipe.train_candidates
    x, sigma, pos, neg = _inputs(bench, max(mb for _, mb in cands))
    results, by_backend = [], {}
    for fraction, mb in cands:
        results.append(
            {
                "checkpointing": fraction,
                "micro_batch": mb,
                **_time_train(bench, fraction, mb, x, sigma, pos, neg, "default"),
            }
        )
    fitting = [
        c for c in results if c["ms_per_image"] is not None and (c["peak_gib"] or 0.0) <= memory_limit_gib(bench.device)
    ]
    best = min(fitting or results, key=lambda c: c["ms_per_image"] or float("inf"))
    for name in sdpa_names:
        by_backend[name] = _time_train(bench, best["checkpointing"], best["micro_batch"], x, sigma, pos, neg, name)
    return {
        "candidates": results,
        "sdpa_train": {"checkpointing": best["checkpointing"], "micro_batch": best["micro_batch"], **by_backend},
    }


def memory_limit_gib(device: str) -> float:
    """85% of the GPU's memory: what `auto` settings may peak at (no limit on CPU)."""
    if not device.startswith("cuda"):
        return float("inf")
    return 0.85 * torch.cuda.get_device_properties(0).total_memory / 2**30


def _time_train(bench, fraction, mb, x, sigma, pos, neg, backend) -> dict:
    a, g, shape = bench.adapter, bench.recipe.guidance_scale, bench.shape
    common.set_checkpointing(a.transformer, fraction)

    def fwd_bwd():
        v = a.velocity(x[:mb], sigma[:mb], _rows(pos, mb), _rows(neg, mb), guidance_scale=g, shape=shape)
        v.square().mean().backward()

    common.reset_peak(bench.device)
    try:
        with common.sdpa_backend(backend):
            seconds = common.time_median(fwd_bwd, repeats=2, warmup=1, device=bench.device)
        result = {"ms_per_image": 1e3 * seconds / mb, "peak_gib": common.peak_gib(bench.device)}
    except torch.OutOfMemoryError:
        result = {"ms_per_image": None, "peak_gib": None, "error": "out of memory"}
    except RuntimeError as err:
        result = {"ms_per_image": None, "peak_gib": None, "error": str(err).splitlines()[0][:160]}
    for p in bench.trainer.params:
        p.grad = None
    common.reset_peak(bench.device)
    return result


def choose_levers(args, recipe: Recipe, probes: dict) -> list[Levers]:
    """Levers of the main measurement, best first: given values, or for `auto` the probed settings that fit
    in 85% of the GPU's memory, fastest first (the largest micro-batch is not always the fastest)."""
    sdpa = args.sdpa
    if sdpa == "auto":  # per image: N rollout forwards + T trained forward/backward passes
        times = probes["forward"]["sdpa_ms_per_image"]
        trains = probes["training"]["sdpa_train"]
        ok = [n for n, t in times.items() if isinstance(t, float) and (trains.get(n) or {}).get("ms_per_image")]
        trained = trained_steps(recipe)
        sdpa = (
            min(ok, key=lambda n: recipe.num_inference_steps * times[n] + trained * trains[n]["ms_per_image"])
            if ok
            else "default"
        )
    fraction, micro = args.checkpointing, args.micro_batch
    if "auto" in (fraction, micro):
        limit = memory_limit_gib(args.device)
        fits = [
            c
            for c in probes["training"]["candidates"]
            if c["ms_per_image"] is not None
            and (c["peak_gib"] or 0.0) <= limit
            and fraction in ("auto", float(c["checkpointing"]))
            and micro in ("auto", int(c["micro_batch"]))
        ]
        if not fits:
            raise ValueError(
                f"no probed (checkpointing, micro_batch) setting ran for --checkpointing {fraction} "
                f"--micro-batch {micro}; give both explicitly"
            )
        ranked = [(c["checkpointing"], c["micro_batch"]) for c in sorted(fits, key=lambda c: c["ms_per_image"])]
    else:
        ranked = [(fraction, micro)]
    return [
        Levers(
            rollout_batch=args.rollout_batch or recipe.rollout_batch,
            micro_batch=int(m),
            checkpointing=float(f),
            sdpa=sdpa,
            compile=args.compile,
            old_log_probs=args.old_log_probs,
            tf32=args.tf32,
            lora_compute=args.lora_compute,
            ode_tail=args.ode_tail or recipe.ode_tail,
            ode_head=args.ode_head,
            weights=args.weights,
            sort_by_window=recipe.sort_by_window if args.sort_by_window is None else args.sort_by_window == "on",
        )
        for f, m in ranked
    ]


# ---- phases and the result -------------------------------------------------------------------------
def run_phase(bench: Bench, name: str, levers: Levers, warmup: int, steps: int) -> dict:
    """Apply the levers, run warm-up + timed RL steps; per-stage mean seconds over the timed steps."""
    started = time.perf_counter()
    bench.apply(levers)
    common.reset_peak(bench.device)
    records, clock = [], StepClock()
    for i in range(warmup + steps):
        if i == warmup:
            evaluations = bench.engine.evaluations
        records.append(bench.step(bench.args.step_offset + i, clock))
    bench.args.step_offset += warmup + steps
    timed = records[warmup:]
    images = len(bench.prompts) * bench.recipe.group_size
    keys = ("step", "rollout", "rollout_wait", "reward", "reward_wait", "update", "sync")
    stages = {k: sum(r[k] for r in timed) / len(timed) for k in keys}
    return {
        "name": name,
        "levers": dataclasses.asdict(levers),
        "images_per_step": images,
        "warmup_steps": warmup,
        "timed_steps": steps,
        "images_per_gpu_s": images / stages["step"],
        "seconds_per_step": stages["step"],
        "step_seconds_each": [r["step"] for r in timed],
        "stage_seconds": stages,
        "stage_ms_per_image": {k: 1e3 * v / images for k, v in stages.items()},
        "first_step_seconds": records[0]["step"],
        "peak_memory_gib": common.peak_gib(bench.device),
        "logprob_gap_mean": timed[-1]["logprob_gap"],
        # transformer evaluations per image in the rollout (the schedule's steps, fewer with an ODE shortcut)
        "rollout_evaluations_per_image": (bench.engine.evaluations - evaluations) / (images * steps),
        "phase_wall_seconds": time.perf_counter() - started,
    }


def trained_steps(recipe: Recipe) -> int:
    """Denoising steps trained per sample."""
    window = recipe.algorithm.window
    sized = ("random_start", "mix_random", "mix_progressive")  # a window of `size` steps; all_but_last: N - 1
    return window.size if window.kind in sized else recipe.num_inference_steps - 1


SAMPLER_LEVERS = ("ode_tail", "ode_head", "sort_by_window")  # the levers that change the rollout's evaluations


def counted_phase(main_phase: dict, phase: dict, main: Levers, changed: Levers) -> dict:
    """The phase whose measured rollout evaluations a variant's FLOPs count: main's when the variant keeps main's
    sampler (timed without a warm-up, it can time a rollout the run-ahead sampled before it began: 0 evaluations
    seen), its own when it changes one of SAMPLER_LEVERS (sorted rows change the ODE tail's evaluations too)."""
    same = all(getattr(changed, name) == getattr(main, name) for name in SAMPLER_LEVERS)
    return main_phase if same else phase


def shortcut_evaluations(phase: dict, levers: Levers) -> float | None:
    """The phase's measured rollout evaluations per image when an ODE shortcut is on, else None (the schedule's
    steps): a variant timed without a warm-up step can time a rollout the run-ahead sampled before it started, whose
    evaluations it never saw."""
    shortcut = levers.ode_tail != "off" or levers.ode_head != "off"
    return phase["rollout_evaluations_per_image"] if shortcut else None


def flop_model(recipe: Recipe, probes: dict, levers: Levers, evaluations: float | None = None) -> dict:
    """Model FLOPs per image of one RL step (see the module docstring); `evaluations`: the rollout's measured
    transformer evaluations per image (None: the schedule's steps)."""
    f, c = probes["forward"]["forward_flops"], 2 if recipe.guidance_scale > 1 else 1
    trained = trained_steps(recipe)
    parts = {
        "rollout": (recipe.num_inference_steps if evaluations is None else evaluations) * c * f,
        "decode": probes["forward"]["decode_flops"],
        "train": trained * c * 2 * f,
        "reference": trained * c * f if recipe.algorithm.kl_coef > 0 and levers.kl else 0,
        "old_log_prob_recompute": trained * c * f if levers.old_log_probs == "recompute" else 0,
    }
    return {
        "forward_flops_per_image": f,
        "cfg_multiplier": c,
        "trained_steps_per_sample": trained,
        "flops_per_image": parts,
        "total_flops_per_image": sum(parts.values()),
    }


def add_mfu(phase: dict, flops: dict, measured_tflops: float | None) -> None:
    achieved = flops["total_flops_per_image"] * phase["images_per_gpu_s"] / 1e12
    phase["achieved_tflops"] = achieved
    phase["mfu_datasheet"] = achieved / DATASHEET_TFLOPS if measured_tflops else None
    phase["mfu_measured_matmul"] = achieved / measured_tflops if measured_tflops else None
    phase["ceiling_images_per_s"] = measured_tflops * 1e12 / flops["total_flops_per_image"] if measured_tflops else None


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, choices=sorted(RECIPES))
    parser.add_argument("--quick", action="store_true", help="one prompt (one group) per step instead of the recipe's")
    parser.add_argument(
        "--prompts",
        type=int,
        default=None,
        help="with --quick/--tiny: prompts per step (e.g. 4: 64 Qwen-Image rows, the YAML's chunk_size, in 4 forward "
        "batches, which rollout.sort_by_window can reorder)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny models, 64x64 (CPU smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rollout-batch", type=int, default=None, help="samples per rollout forward (CFG doubles it)")
    parser.add_argument("--micro-batch", default="auto", help="trainer micro-batch, or auto (fastest probed that fits)")
    parser.add_argument("--checkpointing", default="auto", help="fraction of blocks checkpointed (0..1) or auto")
    parser.add_argument("--sdpa", default="default", choices=[*common.SDPA_BACKENDS, "auto"])
    parser.add_argument("--compile", action="store_true", help="torch.compile the transformer blocks")
    parser.add_argument("--old-log-probs", default="auto", choices=["auto", "recompute"])
    parser.add_argument("--tf32", action="store_true", help="CUDA fp32 matmuls (the LoRA branches) on TF32 cores")
    parser.add_argument(
        "--lora-compute",
        default="fp32",
        choices=["fp32", "base"],
        help="LoRA matmuls in fp32 or in the base's bf16 (train.lora_compute)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the main measurement, profile a steady-state step: device time by kernel kind and stage, GPU "
        "busy fraction, top kernels into the JSON (benchmarks/kernel_profile.py)",
    )
    parser.add_argument(
        "--sync-points",
        action="store_true",
        help="after the main measurement (and the profile), two more steps recording every synchronising CUDA call "
        "by stage and call site into the JSON (benchmarks/sync_points.py; CUDA only)",
    )
    parser.add_argument(
        "--variants",
        default="recompute_old_log_probs,full_checkpointing,no_kl,sdpa_default,compile",
        help=f"comma list of {sorted(VARIANTS)} (or empty), each timed after the main measurement",
    )
    parser.add_argument(
        "--ode-tail", default=None, help="rollout.ode_tail of the main levers: off or SOLVER:K (default: the recipe's)"
    )
    parser.add_argument("--ode-head", default="off", help="rollout.ode_head of the main levers: off or SOLVER:K")
    parser.add_argument(
        "--sort-by-window",
        default=None,
        choices=["on", "off"],
        help="rollout.sort_by_window of the main levers: forward batches of rows sorted by window start "
        "(default: the recipe's)",
    )
    parser.add_argument(
        "--weights", default="lora", help="rollout.weights of the main levers: lora, merged, fp8 or KIND:deterministic"
    )
    parser.add_argument("--variant-steps", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=480.0, help="skip variants that would end past this (s)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<recipe>_<device>.json)")
    args = parser.parse_args(argv)
    for name in ("micro_batch", "checkpointing"):
        value = getattr(args, name)
        if value != "auto":
            setattr(args, name, int(value) if name == "micro_batch" else float(value))
    (
        ode_shortcut(args.ode_tail or "off"),
        ode_shortcut(args.ode_head),
    )  # a bad value fails here, before the model is built
    rollout_weights(args.weights)
    if args.prompts is not None and args.prompts < 1:
        raise ValueError(f"--prompts must be >= 1 (prompts per step with --quick/--tiny); got {args.prompts}")
    unknown = [v for v in filter(None, args.variants.split(",")) if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants {unknown} unknown; choose from {sorted(VARIANTS)}")
    args.step_offset = 0
    return args


def scaled_recipe(args) -> Recipe:
    """The recipe at the requested size: --quick keeps --prompts prompts (one group each, default 1) in one generate
    call and optimizer step; --tiny shrinks everything for the CPU."""
    recipe = RECIPES[args.recipe]
    if args.quick or args.tiny:
        prompts = 1 if args.prompts is None else args.prompts
        recipe = dataclasses.replace(recipe, prompts_per_step=prompts, mini_batch_prompts=prompts)
    if args.tiny:
        tokens = 8 if recipe.arch == "qwen_image" else recipe.text_tokens
        window = recipe.algorithm.window
        if window.kind == "random_start":  # the window must fit in the 4 tiny steps
            window = dataclasses.replace(window, start_range=(0, 3))
        recipe = dataclasses.replace(
            recipe,
            resolution=64,
            num_inference_steps=4,
            group_size=2,
            rollout_batch=2,
            text_tokens=tokens,
            negative_tokens=min(recipe.negative_tokens, tokens),
            algorithm=dataclasses.replace(recipe.algorithm, window=window),
            train_candidates=((1.0, 2), (0.0, 2), (0.5, 2)),
        )
    return recipe


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.sync_points and not args.device.startswith("cuda"):
        raise SystemExit("--sync-points records synchronising CUDA calls: it needs --device cuda")
    recipe = scaled_recipe(args)
    started = time.perf_counter()
    slug = common.device_slug(args.device)
    out = args.out or (
        None
        if args.tiny
        else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"{args.recipe}_{slug}.json")
    )
    import diffusers

    result: dict = {
        "recipe": args.recipe,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "device_slug": slug,
        "gpus": 1,
        "quick": args.quick,
        "tiny": args.tiny,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "command": " ".join(["python", "-m", "benchmarks.rl_step", *(argv or sys.argv[1:])]),
        "settings": {
            k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
            for k, v in dataclasses.asdict(recipe).items()
        },
        "text_side": "random prompt embeddings of the real shapes via the engine's embedding-cache path; "
        "no text encoder on the GPU",
        "reward": "jpeg_compressibility (rule reward, CPU)",
        "published_images_per_gpu_s": PUBLISHED[args.recipe],
    }
    workdir = tempfile.mkdtemp(prefix="rl_step_")  # the configs-only model folder, removed at the end
    bench = Bench(recipe, args, workdir)
    size = "tiny" if args.tiny else "real-size"
    result["model"] = f"model.path random: {size} {common.PLANS[recipe.arch]} configs without text encoders"
    result["build_seconds"] = time.perf_counter() - started
    result["matmul_tflops_measured"] = common.matmul_tflops(args.device)
    probes = {"forward": probe_forwards(bench)}
    probes["training"] = probe_training(
        bench, [n for n, t in probes["forward"]["sdpa_ms_per_image"].items() if isinstance(t, float) and n != "default"]
    )
    result["probes"] = probes
    common.write_json(out, result)
    main_phase, levers, result["main_attempts"] = None, None, []
    for levers in choose_levers(args, recipe, probes):
        try:
            main_phase = run_phase(bench, "main", levers, args.warmup, args.steps)
            break
        except torch.OutOfMemoryError:  # recorded: the next-fastest probed setting is tried
            result["main_attempts"].append({"levers": dataclasses.asdict(levers), "error": "out of memory"})
            common.reset_peak(args.device)
    if main_phase is None:
        raise RuntimeError(f"every probed setting ran out of memory in a full step: {result['main_attempts']}")
    result["flops"] = flop_model(recipe, probes, levers, shortcut_evaluations(main_phase, levers))
    add_mfu(main_phase, result["flops"], result["matmul_tflops_measured"])
    result.update(
        images_per_gpu_s=main_phase["images_per_gpu_s"],
        seconds_per_step=main_phase["seconds_per_step"],
        stage_seconds=main_phase["stage_seconds"],
        stage_ms_per_image=main_phase["stage_ms_per_image"],
        peak_memory_gib=main_phase["peak_memory_gib"],
        mfu=main_phase["mfu_datasheet"],
        main=main_phase,
        variants=[],
    )
    common.write_json(out, result)
    if args.profile:
        result["profile"] = profile_step(bench)
        common.write_json(out, result)
    if args.sync_points:
        result["sync_points"] = sync_points_of_steps(bench)
        common.write_json(out, result)
    for name in filter(None, args.variants.split(",")):
        _run_variant(bench, result, name, levers, main_phase, started)
        common.write_json(out, result)
    result["total_wall_seconds"] = time.perf_counter() - started
    shutil.rmtree(workdir, ignore_errors=True)
    common.write_json(out, result)
    _print_summary(result)
    return result


def _run_variant(bench: Bench, result: dict, name: str, levers: Levers, main_phase: dict, started: float) -> None:
    args, overrides = bench.args, VARIANTS[name]
    changed = dataclasses.replace(levers, **overrides)
    if changed == levers or (name == "no_kl" and bench.recipe.algorithm.kl_coef == 0):
        result["variants"].append({"name": name, "skipped": "same as the main levers"})
        return
    warmup = 1 if name == "compile" or bench.compiled else 0  # compiled blocks recompile for changed levers
    if ROLLOUT_LEVERS & overrides.keys():
        # a rollout lever: the run-ahead worker has already sampled the next step with the previous levers (measured
        # on the CPU: the first variant's timed step then made no transformer evaluation), so warm up one step
        warmup = max(warmup, 1)
    if "weights" in overrides and bench.compiled:
        # measured on an H200: the first timed step of a rollout-weights variant held the compile of its new
        # forwards (the run-ahead rollout of that step is the first one with the new classes), 42 s against 14 s
        warmup = 2
    # Compilation costs several steps' worth of time; others about one step each.
    expected = main_phase["seconds_per_step"] * (args.variant_steps + warmup * 4)
    if time.perf_counter() - started + expected > args.time_limit:
        result["variants"].append({"name": name, "skipped": f"time limit {args.time_limit:.0f} s"})
        return
    try:
        phase = run_phase(bench, name, changed, warmup, args.variant_steps)
    except (torch.OutOfMemoryError, RuntimeError) as err:  # recorded in the result; the main figure stands
        result["variants"].append(
            {
                "name": name,
                "levers": dataclasses.asdict(changed),
                "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}",
            }
        )
        common.reset_peak(args.device)
        bench.apply(levers)
        return
    flops = flop_model(
        bench.recipe,
        result["probes"],
        changed,
        shortcut_evaluations(counted_phase(main_phase, phase, levers, changed), changed),
    )
    add_mfu(phase, flops, result["matmul_tflops_measured"])
    if name == "compile":
        phase["compile_seconds_estimate"] = phase["first_step_seconds"] - phase["seconds_per_step"]
    result["variants"].append(phase)
    bench.apply(levers)  # back to the main levers (compilation stays)


def profile_step(bench: Bench) -> dict:
    """Two more RL steps under torch.profiler, the second one summarised: its device time by kernel kind and by stage,
    how busy the GPU was, and the top kernels (benchmarks/kernel_profile.py).

    The window is a steady-state step as a run sees it, from the end of one step to the end of the next: the run-ahead
    worker runs a step's stages from the previous step's weight sync on, so the step before is profiled too (its
    stage ranges open the ones the window finishes) and left out of the summary."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from diffrl.engines.step.run import STAGES

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.device.startswith("cuda") else [])
    clock = StepClock()
    with kernel_profile.stage_ranges(STAGES), profile(activities=activities) as prof:
        bench.step(bench.args.step_offset, clock)
        with record_function(kernel_profile.WINDOW):
            stages = bench.step(bench.args.step_offset + 1, clock)
            common.synchronize(bench.device)
    bench.args.step_offset += 2
    kernels, ranges, window = kernel_profile.profile_rows(prof)
    return {"stage_seconds": stages, **kernel_profile.summarize(kernels, ranges, window)}


def sync_points_of_steps(bench: Bench, steps: int = 2) -> dict:
    """`steps` more RL steps with every synchronising CUDA call recorded by stage and call site
    (benchmarks/sync_points.py): what makes the host wait for the GPU, where the profile shows it idle."""
    from diffrl.engines.step.run import STAGES

    records: list[sync_points.SyncRecord] = []
    clock = StepClock()
    with sync_points.recording(STAGES, records):
        for i in range(steps):
            bench.step(bench.args.step_offset + i, clock)
        common.synchronize(bench.device)
    bench.args.step_offset += steps
    return sync_points.summarize(records, steps)


def _print_summary(result: dict) -> None:
    print(json.dumps({k: result[k] for k in ("probes", "flops")}, indent=1, default=str))
    print(f"{'phase':<26}{'img/GPU/s':>10}{'s/step':>9}{'rollout':>9}{'update':>9}{'peak GiB':>9}{'MFU':>7}")
    for phase in [result["main"], *result["variants"]]:
        if "skipped" in phase or "error" in phase:
            print(f"{phase['name']:<26} {phase.get('skipped') or phase.get('error')}")
            continue
        st, mfu, peak = phase["stage_seconds"], phase.get("mfu_datasheet"), phase["peak_memory_gib"]
        print(
            f"{phase['name']:<26}{phase['images_per_gpu_s']:>10.3f}{phase['seconds_per_step']:>9.2f}"
            f"{st['rollout']:>9.2f}{st['update']:>9.2f}{(peak or 0):>9.1f}{(mfu or 0):>7.3f}"
        )
    if "profile" in result:
        print(kernel_profile.format_summary(result["profile"]))
    if "sync_points" in result:
        print(sync_points.format_summary(result["sync_points"]))


if __name__ == "__main__":
    main()
