"""Seeded random Trajectories of a given size, for the store's tests and benchmarks/store_io.py.

Images are smooth gradients plus noise (roughly as compressible as generated images), so PNG
sizes and encode times are realistic rather than those of pure noise or of flat colour.
"""

from __future__ import annotations

import torch

from diffrl.engines.trajectories import Trajectories


def random_trajectories(
    num_prompts: int,
    group_size: int,
    *,
    latent_shape: tuple[int, ...] = (4, 8, 8),
    window: int = 2,
    image_size: int = 16,
    num_frames: int = 0,
    seed: int = 0,
    prompt_offset: int = 0,
    policy_version: int = 0,
) -> Trajectories:
    """num_prompts x group_size samples; prompt uids are f"uid{prompt_offset + p}".

    latents (B, window + 1, *latent_shape) fp32; images (B, H, W, 3) or (B, F, H, W, 3) uint8.
    """
    g = torch.Generator().manual_seed(seed)
    b = num_prompts * group_size
    prompt_ids = [prompt_offset + p for p in range(num_prompts) for _ in range(group_size)]
    frames = (num_frames,) if num_frames else ()
    yy, xx = torch.meshgrid(torch.arange(image_size), torch.arange(image_size), indexing="ij")
    base = torch.stack([xx, yy, (xx + yy) // 2], -1) * (255 // max(image_size - 1, 1))
    noise = torch.randint(0, 24, (b, *frames, image_size, image_size, 3), generator=g)
    images = ((base + noise) % 256).to(torch.uint8)
    sigmas = torch.rand(b, window, generator=g)
    return Trajectories(
        prompts=[f"a photo of thing {p} with \"text\" and 'quotes'" for p in prompt_ids],
        group_ids=[f"uid{p}" for p in prompt_ids],
        sample_index=torch.arange(group_size).repeat(num_prompts),
        seeds=torch.randint(0, 2**62, (b,), generator=g),
        latents=torch.randn(b, window + 1, *latent_shape, generator=g),
        log_probs=torch.randn(b, window, generator=g),
        sigmas=sigmas,
        sigmas_prev=sigmas * 0.9,
        window_starts=torch.randint(0, 10, (b,), generator=g),
        trained=torch.rand(b, window, generator=g) > 0.3,
        images=images,
        embed_keys=[f"emb{p}" for p in prompt_ids],
        metadata=[{"ground_truth": f"text {p}", "i": i} for i, p in enumerate(prompt_ids)],
        policy_version=policy_version,
    )
