"""Tiny FluxKontextPipeline (arch "flux_kontext"): the tiny FLUX.1 pipeline (diffrl/models/flux/tiny.py: CLIP + T5, a
16-channel VAE, packed latents, a guidance embedding) under FLUX.1-Kontext's pipeline class, which puts the input
image's VAE latents next to the noisy ones along the token sequence. FLUX.1-Kontext-dev has FLUX.1-dev's layout."""

from __future__ import annotations

import torch
from diffusers import FluxKontextPipeline

from diffrl.models.flux.tiny import tiny_flux_pipeline
from diffrl.models.tiny import register_tiny


@register_tiny("flux_kontext")
def build_flux_kontext(out_dir: str, seed: int) -> None:
    """Build the tiny FLUX.1-Kontext pipeline (seeded random weights) and save it to out_dir."""
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        parts = tiny_flux_pipeline().components
    FluxKontextPipeline(**parts).save_pretrained(out_dir, safe_serialization=True)
