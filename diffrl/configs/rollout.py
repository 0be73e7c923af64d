"""Sampling settings of one rollout (what `diffrl sample` and the RL flows pass to the engine): SamplingConfig for
diffusion, TokenSampling for autoregressive models. Plain dataclasses, so the config schema loads without the
engines' model libraries (importing diffrl.engines.rollout.tokens for TokenSampling took transformers' modeling
with it: 3.6 s of the 6.5 s a mistyped `diffrl train` key took to report)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffrl.algorithms.ode import ODE_SOLVERS
from diffrl.algorithms.sde import SDE_TYPES
from diffrl.algorithms.windows import WindowPolicy


@dataclass(frozen=True)
class OdeShortcut:
    """Fewer transformer evaluations for a run of deterministic steps that every sample of a chunk shares.

    ``solver`` "none" (the default; not "off", which YAML reads as false) runs those steps one by one as Euler steps,
    as without this option; "euler", "dpm2m" or "ab2" (algorithms/ode.py) integrates them on a sub-schedule of the
    model's own sigmas with ``evaluations`` transformer evaluations (MixGRPO-Flash, arXiv:2507.21802). It applies
    only where the run has more steps than ``evaluations``; shorter runs keep their steps.
    """

    solver: str = "none"  # none (off: Euler steps one by one) | euler | dpm2m | ab2: the solver of the shortcut
    evaluations: int = 2  # transformer evaluations the shortcut integrates those steps with

    def __post_init__(self) -> None:
        if self.solver != "none" and self.solver not in ODE_SOLVERS:
            raise ValueError(f"solver must be 'none' (off) or one of {list(ODE_SOLVERS)}; got {self.solver!r}")
        if self.evaluations < 1:
            raise ValueError(f"evaluations must be >= 1 (transformer evaluations of the run); got {self.evaluations}")

    @property
    def on(self) -> bool:
        return self.solver != "none"


WEIGHT_KINDS = ("lora", "merged", "fp8")
WEIGHT_STEPS = ("all", "deterministic")


@dataclass(frozen=True)
class RolloutWeights:
    """Which weights the rollout's transformer forwards run with (engines/rollout/fast_weights.py).

    ``kind`` "lora" (the default) runs the trained module as the trainer does; "merged" runs each LoRA-wrapped
    linear as one matmul on a rollout-only copy of W + the active adapters' delta; "fp8" also runs every eligible
    linear with an FP8 e4m3 copy of its weight and per-token FP8 inputs. ``steps`` "all" uses those weights for every
    forward, so the rollout's log-probs are no longer the trainer's numerics and ``train.old_log_probs: auto``
    recomputes them; "deterministic" only for forwards in which no sample is inside its SDE window (and the ODE
    shortcuts), so the stored window latents and log-probs stay the trainer's numerics and only the final sample
    changes.
    """

    kind: str = "lora"  # lora (the trained module) | merged (W + the adapters' delta, one matmul) | fp8
    steps: str = "all"  # all (every forward) | deterministic (forwards with no sample inside its window)

    def __post_init__(self) -> None:
        if self.kind not in WEIGHT_KINDS:
            raise ValueError(f"weights.kind must be one of {list(WEIGHT_KINDS)}; got {self.kind!r}")
        if self.steps not in WEIGHT_STEPS:
            raise ValueError(f"weights.steps must be one of {list(WEIGHT_STEPS)}; got {self.steps!r}")

    @property
    def trainer_numerics(self) -> bool:
        """Whether every stored log-prob of a rollout with these weights is computed as the trainer's replay is."""
        return self.kind == "lora" or self.steps == "deterministic"


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample: resolution, steps, guidance, and which steps are stochastic.

    guidance_scale None means the adapter's default; it maps to the architecture's own knob (SD3/Wan
    CFG, Qwen-Image true CFG, FLUX distilled guidance, Z-Image CFG). negative_prompt is used only when
    the adapter needs a negative at that scale. Steps inside a sample's window (``window``) are
    ``sde_type`` steps at ``noise_level``; all others are Euler ODE steps, except that ``ode_tail`` can integrate the
    steps after the last window of a chunk ends (the stored window latents, sigmas and log-probs do not change,
    the final sample does) and ``ode_head`` those before its first window starts (this changes the window's input
    latents) with fewer evaluations. Both are off by default. ``sort_by_window`` forms the forward batches from the
    rows sorted by window start (a batch's loop and tail then end at its own latest window end; off by default).
    ``weights`` (RolloutWeights) can run the rollout's forwards on a merged or FP8 copy of the weights; off ("lora")
    by default.
    """

    num_inference_steps: int = 10
    height: int = 512
    width: int = 512
    num_frames: int = 1
    duration: float | None = None  # seconds of audio (audio-only models; None: the model's default)
    guidance_scale: float | None = None
    negative_prompt: str = ""
    noise_level: float = 0.7
    sde_type: str = "sde"
    window: WindowPolicy = field(default_factory=lambda: WindowPolicy("all_but_last"))
    max_sequence_length: int | None = None
    batch_size: int = 8  # samples per transformer forward
    same_noise_per_group: bool = False  # DanceGRPO: a group shares its initial noise
    ode_tail: OdeShortcut = field(default_factory=OdeShortcut)
    ode_head: OdeShortcut = field(default_factory=OdeShortcut)
    sort_by_window: bool = False  # forward batches of rows sorted by window start
    weights: RolloutWeights = field(default_factory=RolloutWeights)

    def __post_init__(self) -> None:
        if self.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1; got {self.num_inference_steps}")
        for name in ("height", "width", "num_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"duration must be > 0 seconds or None (the model's default); got {self.duration}")
        if self.noise_level < 0:
            raise ValueError(f"noise_level must be >= 0 (0 = deterministic ODE sampling); got {self.noise_level}")
        if self.sde_type not in SDE_TYPES:
            raise ValueError(f"sde_type must be one of {list(SDE_TYPES)}; got {self.sde_type!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {self.batch_size}")
        if self.guidance_scale is not None and self.guidance_scale < 0:
            raise ValueError(f"guidance_scale must be >= 0 or None (the model's default); got {self.guidance_scale}")
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1 or None; got {self.max_sequence_length}")
        for name in ("ode_tail", "ode_head"):
            if not isinstance(getattr(self, name), OdeShortcut):
                raise TypeError(f"{name} must be a configs.rollout.OdeShortcut; got {getattr(self, name)!r}")
        if not isinstance(self.sort_by_window, bool):
            raise TypeError(f"sort_by_window must be a bool; got {self.sort_by_window!r}")
        if not isinstance(self.weights, RolloutWeights):
            raise TypeError(f"weights must be a configs.rollout.RolloutWeights; got {self.weights!r}")
        if not isinstance(self.window, WindowPolicy):
            raise TypeError(f"window must be an algorithms.windows.WindowPolicy; got {type(self.window).__name__}")


@dataclass(frozen=True)
class TokenSampling:
    """How an autoregressive rollout samples (the run's rollout section; names as vLLM's SamplingParams).

    max_new_tokens: response tokens at most. temperature: > 0 samples, 0 decodes greedily (validation).
    top_p in (0, 1]. stop: strings that end a response. batch_size: sequences per generate call.
    """

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    batch_size: int = 8

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError(
                f"max_new_tokens and batch_size must be >= 1; got {self.max_new_tokens}, {self.batch_size}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy); got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
