"""In-process rollout: sample denoising trajectories with log-probs through a model adapter, and
replay any stored step with the same numerics (the trainer)."""

from diffrl.engines.rollout.engine import RolloutEngine
from diffrl.engines.rollout.step import denoise_step

__all__ = ["RolloutEngine", "denoise_step"]
