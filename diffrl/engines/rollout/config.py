"""Sampling settings of one rollout (what `diffrl sample` and the RL flows pass to the engine): SamplingConfig for
diffusion, TokenSampling for autoregressive models. Plain dataclasses, so the config schema loads without the
engines' model libraries (importing diffrl.engines.rollout.tokens for TokenSampling took transformers' modeling
with it: 3.6 s of the 6.5 s a mistyped `diffrl train` key took to report)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffrl.algorithms.sde import SDE_TYPES
from diffrl.algorithms.windows import WindowPolicy


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample: resolution, steps, guidance, and which steps are stochastic.

    guidance_scale None means the adapter's default; it maps to the architecture's own knob (SD3/Wan
    CFG, Qwen-Image true CFG, FLUX distilled guidance, Z-Image CFG). negative_prompt is used only when
    the adapter needs a negative at that scale. Steps inside a sample's window (``window``) are
    ``sde_type`` steps at ``noise_level``; all others are Euler ODE steps.
    """

    num_inference_steps: int = 10
    height: int = 512
    width: int = 512
    num_frames: int = 1
    guidance_scale: float | None = None
    negative_prompt: str = ""
    noise_level: float = 0.7
    sde_type: str = "sde"
    window: WindowPolicy = field(default_factory=lambda: WindowPolicy("all_but_last"))
    max_sequence_length: int | None = None
    batch_size: int = 8  # samples per transformer forward
    same_noise_per_group: bool = False  # DanceGRPO: a group shares its initial noise

    def __post_init__(self) -> None:
        if self.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1; got {self.num_inference_steps}")
        for name in ("height", "width", "num_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
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
