"""What the leaderboard trains, shared by its runner (leaderboard.py), its parallel runs (leaderboard_parallel.py) and
its report (leaderboard_report.py): the rows and where their settings come from, the CPU miniature, a call's plan, and
where each run's record goes."""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results", "leaderboard")
RESULTS_ASYNC = os.path.join(REPO, "benchmarks", "results", "leaderboard_async")  # the asynchronous rows' runs
# rows measured on another device than the table's, one folder a call, each beside the flow_grpo runs of its call
RESULTS_OTHER_DEVICE = tuple(
    os.path.join(REPO, "benchmarks", "results", name) for name in ("leaderboard_h100", "leaderboard_h100_ema_ref")
)
GPU_CONFIG = "diffrl/configs/shapes_flow_grpo.yaml"
GAIN = 0.10  # "time to +10 points" of held-out strict accuracy


@dataclass(frozen=True)
class Row:
    """One leaderboard entry: a catalog algorithm with the overrides it runs under, and where they come from."""

    name: str
    overrides: tuple[str, ...]
    source: str
    # an asynchronous row: the on-policy row it is compared with (the report's "Asynchronous rows" section)
    on_policy: str | None = None
    # a distilling row: the row whose trained policy of the same seed is its teacher (the runner trains it first)
    teacher: str | None = None


# The base config is the FlowGRPO recipe that learns most here (shapes_flow_grpo.yaml: 4-step CFG-free sampling,
# 32 prompts x 16 samples, LoRA r32, lr 3e-4 on a cosine over 600 steps). Every row keeps its sampling, batch and
# reward, so every row is evaluated at the same sampling setting; KL to the reference is 0 for the policy-gradient
# rows (the recipe measured best without it), so none of them pays a reference forward the others do not.
ROWS = (
    Row(
        "flow_grpo",
        ("algorithm={name: flow_grpo, kl_coef: 0.0, clip_ratio: 0.2, noise_level: 0.7}",),
        "Flow-GRPO (arXiv:2505.05470): SDE noise a=0.7, clip 0.2, group 16; KL 0 as the shipped recipe measured",
    ),
    Row(
        "flow_grpo_fast",
        ("algorithm={name: flow_grpo_fast, kl_coef: 0.0, window: {kind: random_start, size: 2, start_range: [0, 2]}}",),
        "Flow-GRPO-Fast (flow_grpo repo): SDE on a 2-step window with a random start among the early steps, noise 0.8,"
        " its clip 1e-5; scaled: window 2 of 4 steps, start in {0, 1}",
    ),
    Row(
        "mix_grpo",
        (
            "algorithm={name: mix_grpo, kl_coef: 0.0, noise_level: 0.7, window: {kind: mix_progressive, size: 2, "
            "iters_per_group: 50}}",
        ),
        "MixGRPO (arXiv:2507.21802): a sliding SDE window (progressive), ODE elsewhere; paper: window 4 of 25 steps"
        " moved every 25 iterations; scaled: window 2 of 4 steps moved every 50 steps",
    ),
    Row(
        "grpo_guard",
        ("algorithm={name: grpo_guard, kl_coef: 0.0, noise_level: 0.7}",),
        "GRPO-Guard (arXiv:2510.22319): Flow-GRPO with ratio normalisation and gradient reweighting; the Flow-GRPO"
        " row's noise and clip",
    ),
    Row(
        "dance_grpo",
        ("algorithm={name: dance_grpo}",),
        "DanceGRPO (arXiv:2505.07818): every step SDE at eta 0.3, 60 % of the timesteps trained per sample, advantages"
        " per group (std ddof 1); the catalog bundle as is",
    ),
    Row(
        "flow_dppo",
        ("algorithm={name: flow_dppo, noise_level: 0.7}",),
        "Flow-DPPO: the catalog bundle (KL-threshold trust region 1e-5), the Flow-GRPO row's noise",
    ),
    Row(
        "dpo",
        ("algorithm={name: dpo, beta: 5000.0, window: {kind: final, size: 1}}",),
        "Diffusion-DPO (arXiv:2311.12908) online: best vs worst sample of each group of the step, beta 5000 (the"
        " paper's SD1.5 value, in diffrl's flow-matching form)",
    ),
    Row(
        "diffusion_nft",
        (
            "algorithm={name: diffusion_nft, noise_level: 0.5, window: {kind: random_start, size: 4, "
            "start_range: [0, 1]}, ref_coef: 0.0, old_policy_decay_ramp: 0.02, old_policy_decay_max: 0.8}",
        ),
        "DiffusionNFT (arXiv:2509.16117): CFG-free, rollouts from an EMA old policy; the quickstart's measured settings"
        " (noise 0.5, decay min(0.02 step, 0.8), no reference term)",
    ),
    Row(
        "awm",
        ("algorithm={name: awm, ref_coef: 0.1, awm_weighting: uniform, window: {kind: final, size: 1}}",),
        "AWM (advantage-weighted matching): the catalog's reference coefficient 0.1, uniform timestep weighting",
    ),
    Row(
        "dgpo",
        (
            "algorithm={name: dgpo, beta: 100.0, clip_ratio: 0.01, kl_coef: 0.02, train_sigma_steps: 3, window: "
            "{kind: final, size: 1}}",
        ),
        "DGPO (arXiv:2510.08425): group preference on ODE samples, whole groups sharing their noise; the authors' OCR"
        " settings (beta 100, error clip 1e-2 against an EMA old policy, velocity KL 0.02); timestep clip: paper 7"
        " of 10 steps, scaled: 3 of 4",
    ),
    Row(
        "gardo",
        ("algorithm={name: gardo, noise_level: 0.7, clip_ratio: 0.0001, kl_coef: 0.04, reference_reset_every: 16}",),
        "GARDO (arXiv:2512.24138): Flow-GRPO with advantages not divided by the std and a KL 0.04 to a reference reset"
        " to the policy every 16 steps (flow_grpo's OCR settings, reset_freq 15); every sample pays the KL (no"
        " uncertainty gate)",
    ),
    Row(
        "flow_grpo_ema_ref",
        (
            "algorithm={name: flow_grpo, clip_ratio: 0.2, noise_level: 0.7, kl_coef: 0.001, kl_space: velocity, "
            "reference: ema, reference_decay: 0.3, reference_decay_ramp: 0.001}",
        ),
        "the flow_grpo row with a velocity-space KL (Flow-Factory kl_type v-based, its suggested kl_beta ~1e-3) to an"
        " EMA of the policy, decay min(0.001 step, 0.3) (Flow-Factory's old-policy EMA, DGPO ema_ref_ramp_rate and"
        " ema_ref_max_decay)",
    ),
    Row(
        "sft",
        (
            "algorithm={name: sft}",
            "data.sample_source=offline",
            "data.train=generator:shapes",
            "rollout.group_size=1",
            "rollout.prompts_per_step=512",
            "train.mini_batch_prompts=512",
        ),
        "SFT (flow matching, SD3's logit-normal sigma) on data.num_generated = 5000 rendered scenes that satisfy their"
        " prompts, the ground truth the model was pretrained on: what a warm start buys; 512 rows a step, the RL"
        " rows' LoRA and learning rate",
    ),
    Row(
        "diffusion_opd",
        ("algorithm={name: diffusion_opd, noise_level: 0.0, distill_coef: 1.0, fm_coef: 0.0, pg_coef: 0.0}",),
        "DiffusionOPD (arXiv:2605.15055): pure on-policy distillation (the authors' sopd_* recipe: ODE rollout, every"
        " step but the last, distill coefficient 1, no reward term) from a further-trained shapes teacher: the base"
        " model with the LoRA of the flow_grpo row trained for the same budget and seed, which the runner trains first"
        " when its out-dir has none (teachers/flow_grpo_seed<k>/: that run's record and its LoRA)",
        teacher="flow_grpo",
    ),
)
ROW_NAMES = tuple(r.name for r in ROWS)

# The Flow-GRPO row trained one and two policy versions off (run.async.max_staleness, docs/training.md "Asynchronous
# training"), with the decoupled-PPO correction it requires; compared with the on-policy row at equal images
# (`run --budget-images`), not in the default `run` (the leaderboard's rows share a budget of training seconds).
ASYNC_ROWS = tuple(
    Row(
        f"flow_grpo_async{s}",
        (*ROWS[0].overrides, f"run.async.max_staleness={s}", "train.rollout_correction=tis"),
        f"the flow_grpo row with the next step's rollout beside the update, samples up to {s} policy version"
        f"{'s' if s > 1 else ''} old, truncated importance weights on the behaviour ratio (decoupled PPO)",
        on_policy="flow_grpo",
    )
    for s in (1, 2)
)
ALL_ROWS = ROWS + ASYNC_ROWS
ALL_ROW_NAMES = tuple(r.name for r in ALL_ROWS)

# The CPU miniature (tests/benchmarks/test_leaderboard_smoke.py): the CPU model and config, two rows, one seed.
MINIATURE = {
    "config": "shapes_quick",
    "algorithms": ("flow_grpo", "diffusion_nft"),
    "budget_s": 8.0,
    "eval_every_s": 4.0,
    "overrides": (
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.batch_size=8",
        "rollout.chunk_size=8",
        "train.mini_batch_prompts=2",
        "train.micro_batch_size=8",
        "data.num_val_prompts=12",
        "data.val_samples_per_prompt=1",
    ),
}


def run_path(out_dir: str, row: str, seed: int, device_name: str) -> str:
    """Where a run's record goes: <row>_seed<k>_<device>.json ("NVIDIA H200" -> h200, "cpu")."""
    words = device_name.lower().replace("nvidia", "").split() or ["gpu"]
    return os.path.join(out_dir, f"{row}_seed{seed}_{re.sub(r'[^a-z0-9]+', '_', words[0])}.json")


@dataclass(frozen=True)
class Plan:
    """What a `run` or `probe` call trains: the base config, the rows and seeds, the budget and every run's overrides
    (`--miniature` resolved). With `budget_images`, a run stops at images seen instead of seconds of training and is
    evaluated every `eval_every_images` images."""

    config: str
    names: tuple[str, ...]
    seeds: tuple[int, ...]
    budget_s: float
    eval_every_s: float
    extra: tuple[str, ...]
    budget_images: int | None = None
    eval_every_images: int | None = None

    def rows(self) -> list[Row]:
        return [r for r in ALL_ROWS if r.name in self.names]

    def child_argv(self, row: Row, seed: int, out_dir: str, concurrent: int, barrier: str | None = None) -> list[str]:
        """The command line of a child process training one (row, seed) of this plan (overrides first: `--seeds`
        and `--algorithms` take every word after them)."""
        argv = [sys.executable, "-m", "benchmarks.leaderboard", "run", *self.extra, "--algorithms", row.name]
        argv += ["--seeds", str(seed), "--config", self.config, "--budget-s", str(self.budget_s)]
        argv += ["--eval-every-s", str(self.eval_every_s), "--out-dir", out_dir, "--concurrent", str(concurrent)]
        if self.budget_images is not None:
            argv += ["--budget-images", str(self.budget_images), "--eval-every-images", str(self.eval_every_images)]
        return argv + (["--barrier", barrier] if barrier else [])


def finished_run(out_dir: str, row: str, seed: int) -> str | None:
    """The file name of a finished run of (row, seed) in out_dir, on any device, or None."""
    pattern = re.compile(rf"{re.escape(row)}_seed{seed}_[a-z0-9_]+\.json")
    for name in sorted(os.listdir(out_dir)):
        if pattern.fullmatch(name):
            with open(os.path.join(out_dir, name)) as f:
                if json.load(f).get("finished"):
                    return name
    return None
