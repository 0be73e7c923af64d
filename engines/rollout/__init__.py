"""In-process rollout: sample denoising trajectories with log-probs through a model adapter, and
replay any stored step with the same numerics (the trainer)."""

from engines.rollout.config import SamplingConfig
from engines.rollout.engine import RolloutEngine
from engines.rollout.step import denoise_step

__all__ = ["RolloutEngine", "SamplingConfig", "denoise_step"]
