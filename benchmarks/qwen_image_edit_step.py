"""GPU benchmark of Qwen-Image-Edit's denoiser at real size: what editing costs over text-to-image (not run yet).

Qwen-Image-Edit is Qwen-Image's 20.4 B transformer and VAE; what changes is the sequence. Each forward carries the
noisy latents (L tokens: 1,024 at 512x512), the input image's VAE latents (L' tokens: upstream resizes every input
image to about 1024x1024, so 4,096) and the text, which holds the input image's vision tokens too (Qwen2.5-VL's image
processor at its default max_pixels turns a 1024x1024 image into 37 x 37 = 1,369 merged tokens, plus the
instruction). Built with random weights on the device (benchmarks/common.py: real transformer and VAE, no text
encoder; random encodings of those shapes stand in for the cached ones, as a run reads them after the first step).

Timed (median of --repeats after --warmup): the VAE encode of one 1024x1024 input image (once per image: the
encoding is cached); one CFG forward of the rollout at batch --batch (cond + uncond in one forward, as the adapter
runs it) for the edit and for the same batch of text-to-image Qwen-Image; one LoRA forward + backward of a training
micro-batch (--micro-batch, conditional only, gradient checkpointing on every block). Peak memory is recorded.

    python -m benchmarks.qwen_image_edit_step --device cuda --out benchmarks/results/qwen_image_edit_step_h200.json
    python -m benchmarks.qwen_image_edit_step --tiny --device cpu --out /tmp/edit.json   # smoke test (meaningless)
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import common
from diffrl.models.base import SampleShape
from diffrl.models.qwen_image.adapter_edit import QwenImageEditAdapter

VISION_TOKENS = 37 * 37  # Qwen2.5-VL, 1024x1024 input, patch 14, merge 2, default max_pixels
INSTRUCTION_TOKENS = 24


def edit_adapter(base, device: str, dtype: torch.dtype) -> QwenImageEditAdapter:
    """The edit adapter over the benchmark's random Qwen-Image transformer and VAE (no text encoder)."""
    from diffusers import QwenImageEditPipeline

    pipe = QwenImageEditPipeline(
        scheduler=base.pipe.scheduler,
        vae=base.pipe.vae,
        text_encoder=None,
        tokenizer=None,
        processor=None,
        transformer=base.pipe.transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    adapter = QwenImageEditAdapter(pipe, device=device, dtype=dtype)
    adapter.source = base.source + "-edit"
    return adapter


def edit_encoding(adapter, batch: int, condition_side: int, text_tokens: int, generator) -> dict[str, torch.Tensor]:
    """A batch of edit encodings of the real shapes: text (+ vision) embeddings and the input image's latents."""
    enc = common.random_encoding(adapter, text_tokens, generator)
    grid = condition_side // 16
    channels = adapter.transformer.config.in_channels
    latents = torch.randn(1, grid * grid, channels, generator=generator).to(adapter.device, adapter.dtype)
    enc.update(image_latents=latents, image_grid=torch.tensor([[grid, grid]], device=adapter.device))
    return {k: v.expand(batch, *v.shape[1:]).contiguous() for k, v in enc.items()}


def measure(args) -> dict:
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    base = common.build_adapter("qwen_image", tiny=args.tiny, device=args.device, dtype=dtype)
    adapter = edit_adapter(base, args.device, dtype)
    side, condition = (64, 128) if args.tiny else (args.size, 1024)
    shape = SampleShape(side, side)
    gen = torch.Generator().manual_seed(0)
    vision = 4 if args.tiny else VISION_TOKENS
    enc = edit_encoding(adapter, args.batch, condition, vision + INSTRUCTION_TOKENS, gen)
    neg = edit_encoding(adapter, args.batch, condition, vision + 2, gen)
    text = {k: v for k, v in enc.items() if not k.startswith("image_")}
    text_neg = {k: v[:, :2] for k, v in text.items()}
    x = adapter.prepare_latents(shape, [torch.Generator().manual_seed(i) for i in range(args.batch)]).to(args.device)
    sigma = torch.full((args.batch,), 0.7, device=args.device)
    timed = lambda fn: common.time_median(fn, repeats=args.repeats, warmup=args.warmup, device=args.device)  # noqa: E731
    result = {"device": args.device, "batch": args.batch, "size": side, "condition_size": condition, "tiny": args.tiny}
    pixels = torch.rand(1, 3, 1, condition, condition, device=args.device, dtype=dtype) * 2 - 1
    with torch.no_grad():
        result["vae_encode_s"] = timed(lambda: adapter.pipe._encode_vae_image(pixels, generator=None))
        common.reset_peak(args.device)
        edit_cfg = lambda: adapter.velocity(x, sigma, enc, neg, guidance_scale=4.0, shape=shape)  # noqa: E731
        result["edit_cfg_forward_s"] = timed(edit_cfg)
        result["edit_cfg_forward_peak_gib"] = common.peak_gib(args.device)
        t2i = lambda: base.velocity(x, sigma, text, text_neg, guidance_scale=4.0, shape=shape)  # noqa: E731
        result["t2i_cfg_forward_s"] = timed(t2i)
    result["edit_over_t2i"] = result["edit_cfg_forward_s"] / result["t2i_cfg_forward_s"]
    result.update(train_step(adapter, shape, args, gen))
    return result


def train_step(adapter, shape: SampleShape, args, gen) -> dict:
    """LoRA r64 forward + backward of one conditional micro-batch with checkpointing on every block."""
    from peft import LoraConfig

    transformer = adapter.transformer
    transformer.add_adapter(LoraConfig(r=64, lora_alpha=128, target_modules=list(adapter.default_lora_targets)))
    common.set_checkpointing(transformer, 1.0)
    b = args.micro_batch
    vision = 4 if args.tiny else VISION_TOKENS
    enc = edit_encoding(adapter, b, 128 if args.tiny else 1024, vision + INSTRUCTION_TOKENS, gen)
    x = adapter.prepare_latents(shape, [torch.Generator().manual_seed(i) for i in range(b)]).to(args.device)
    sigma = torch.full((b,), 0.7, device=args.device)

    def step():
        adapter.velocity(x, sigma, enc, None, guidance_scale=1.0, shape=shape).float().square().mean().backward()

    common.reset_peak(args.device)
    seconds = common.time_median(step, repeats=args.repeats, warmup=args.warmup, device=args.device)
    return {
        "lora_fwd_bwd_s": seconds,
        "lora_fwd_bwd_per_image_s": seconds / b,
        "lora_peak_gib": common.peak_gib(args.device),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny smoke-test sizes (numbers are meaningless)")
    parser.add_argument("--size", type=int, default=512, help="output image side (default 512)")
    parser.add_argument("--batch", type=int, default=4, help="rollout batch (default 4)")
    parser.add_argument("--micro-batch", type=int, default=2, help="training micro-batch (default 2)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON result file")
    args = parser.parse_args()
    result = measure(args)
    common.write_json(args.out, result)
    print(result)


if __name__ == "__main__":
    main()
