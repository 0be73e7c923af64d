"""The plain noise-level-0 loop of the adapter contract, shared by the per-architecture parity tests."""

from __future__ import annotations

import torch


def euler_sample(adapter, prompts, seeds, *, guidance_scale, shape, steps=4, negative=""):
    """Encode, draw noise per seed, Euler-integrate the guided velocity, decode to uint8.

    The negative prompt is encoded only when the adapter uses one at this guidance scale;
    negative=None means none at all (Qwen-Image then runs without true CFG, as upstream).
    """
    enc = adapter.encode_prompt(prompts)
    use_negative = negative is not None and adapter.needs_negative(guidance_scale)
    neg = adapter.encode_prompt([negative] * len(prompts)) if use_negative else None
    x = adapter.prepare_latents(shape, [torch.Generator().manual_seed(s) for s in seeds])
    s = adapter.sigmas(steps, shape)
    with torch.no_grad():
        for i in range(steps):
            v = adapter.velocity(x, s[i].expand(len(prompts)), enc, neg, guidance_scale=guidance_scale, shape=shape)
            x = x + (s[i + 1] - s[i]) * v
    return adapter.decode(x, shape)


def pipeline_uint8(pipe, prompt, seed, *, shape, steps, **kwargs) -> torch.Tensor:
    """The upstream pipeline's images (B, H, W, 3) uint8 for one prompt and seed, rounded as `numpy_to_pil` rounds
    them; `kwargs` are the pipeline's guidance knobs."""
    out = pipe(
        prompt=prompt,
        num_inference_steps=steps,
        height=shape.height,
        width=shape.width,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
        **kwargs,
    ).images
    return torch.from_numpy((out * 255).round().astype("uint8"))
