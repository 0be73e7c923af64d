"""BAGEL (ByteDance-Seed, arXiv 2505.14683) text-to-image: the MoT model (mot.py), the official checkpoint folder
(layout.py) and the adapter (adapter.py), registered as the "bagel" architecture when this package is imported."""

from diffrl.models.bagel.adapter import BagelAdapter, BagelPipeline

__all__ = ["BagelAdapter", "BagelPipeline"]
