"""Pretrain the reference shapes model: a small SD3-architecture text-to-image model, from scratch.

    python -m diffrl.shapes.pretrain.sd3 --out DIR --steps N --device cpu|cuda --seed S

What it builds (sd3_model.py: a `StableDiffusion3Pipeline`, so diffrl/models/sd3/adapter.py, the rollout, the
trainer and `diffrl sample/train` load it unchanged):
- VAE: an `AutoencoderKL` with ONE level (vae_scale_factor 1, latents 4 x 64 x 64; `--vae-levels 2` halves
  the side once: latents 4 x 32 x 32, the CPU-sized model), trained first for
  `--vae-steps` to reconstruct the scenes (it is close to identity, so it trains in seconds and its
  decoded colours stay exact enough for the rule-based reward); shift/scaling factors are then set
  from the latents' mean and std, as SD3's are.
- text: two small CLIP text encoders with projection (CLIP-L / CLIP-G roles) on the in-memory
  tokenizers of diffrl/models/tokenizers.py, and a one-layer T5 encoder (the pipeline's from_pretrained
  needs a text_encoder_3) whose final RMS norm weight is 0: it outputs exact zeros, frozen, so the T5
  slot is `max_sequence_length` zero tokens, as the pipeline itself feeds when it has no T5. Training
  cycles the number of those tokens through `--zero-tokens` so the model is indifferent to the
  `max_sequence_length` a sampler picks (a short one is faster on CPU).
- transformer: `SD3Transformer2DModel`, `--patch-size` 4 (16 x 16 = 256 image tokens on one-level latents,
  64 on two-level ones: the CPU-sized model; patch 8 on 64 x 64 latents makes 64 tokens too, but 8 x 8 x 4
  numbers per token exceed the width and it learns far slower), `--width`, `--layers`. `--text-tokens` sets
  the CLIP length (the tokenizers' `model_max_length`, 77 as SD3; every shapes caption fits in 24).
Everything but the VAE trains jointly with the rectified-flow loss (x_sigma = (1 - sigma) x0 + sigma
noise, target noise - x0, logit-normal sigmas as SD3), with caption dropout to "" for CFG, AdamW (`--lr-schedule` and
`--vae-lr-schedule`: constant after warm-up, the default and the shipped models', or a cosine to 0), an
EMA of the weights (saved), and bf16 autocast on CUDA. It then samples the held-out prompts with the
pipeline itself (ODE, `--eval-steps`, `--guidance-scale`) and scores them with `geneval_lite`.
Outputs: the diffusers folder (safetensors) and OUT/pretrain_summary.json.

Legend: N dataset images, B batch, S image side (64), C latent channels (4), T CLIP tokens (77),
Z zero (T5-slot) tokens, J joint_attention_dim, P pooled dim.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, fields
from multiprocessing import get_context

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline

from diffrl.engines.reward.base import build_reward
from diffrl.engines.store.prompts import PromptDataset
from diffrl.shapes.pretrain.sd3_model import IMAGE_SIZE, PretrainConfig, build_pipeline
from diffrl.shapes.scenes import TAGS, scene_pairs


# ------------------------------------------------------------------------------------- data
def _scene_chunk(job: tuple[int, int]) -> tuple[np.ndarray, list[str]]:
    images, captions, _ = scene_pairs(job[1], seed=job[0], image_size=IMAGE_SIZE)
    return images, captions


def make_dataset(num_images: int, seed: int, workers: int) -> tuple[np.ndarray, list[str]]:
    """(images uint8 (N, S, S, 3), captions): chunks of 2000 scenes, chunk i seeded seed * 1_000_003 + i
    (the same data whatever the number of worker processes)."""
    chunk = 2000
    jobs = [
        (seed * 1_000_003 + i, min(chunk, num_images - start)) for i, start in enumerate(range(0, num_images, chunk))
    ]
    workers = workers or os.cpu_count() or 1
    if workers <= 1 or len(jobs) == 1:
        parts = [_scene_chunk(job) for job in jobs]
    else:  # spawn: never fork a process that may hold CUDA or thread pools
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=get_context("spawn")) as pool:
            parts = list(pool.map(_scene_chunk, jobs))
    return np.concatenate([p[0] for p in parts]), [c for p in parts for c in p[1]]


def tokenize(tokenizer, captions: list[str]) -> torch.Tensor:
    """(N, T) input ids exactly as the pipeline's `_get_clip_prompt_embeds` tokenizes."""
    return tokenizer(
        captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids


def encode_text(
    pipe: StableDiffusion3Pipeline, ids_l: torch.Tensor, ids_g: torch.Tensor, num_zero_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_embeds (B, T + Z, J), pooled (B, P)) as `pipe.encode_prompt` computes them (its T5 outputs
    zeros, see zero_t5), but from pre-tokenized ids and with gradients (the CLIP encoders train)."""
    out_l = pipe.text_encoder(ids_l, output_hidden_states=True)
    out_g = pipe.text_encoder_2(ids_g, output_hidden_states=True)
    clip = torch.cat([out_l.hidden_states[-2], out_g.hidden_states[-2]], dim=-1)
    joint = pipe.transformer.config.joint_attention_dim
    clip = F.pad(clip, (0, joint - clip.shape[-1]))
    zeros = clip.new_zeros(clip.shape[0], num_zero_tokens, joint)  # what zero_t5 outputs
    return torch.cat([clip, zeros], dim=1), torch.cat([out_l[0], out_g[0]], dim=-1)


def to_model_range(images_BSS3: torch.Tensor) -> torch.Tensor:
    """uint8 (B, S, S, 3) -> float (B, 3, S, S) in [-1, 1], the VAE's input range."""
    return images_BSS3.permute(0, 3, 1, 2).float() / 127.5 - 1.0


# ------------------------------------------------------------------------------------- math
def logit_normal_sigmas(n: int, shift: float, generator: torch.Generator, device) -> torch.Tensor:
    """(n,) sigmas: sigmoid of a standard normal (SD3's logit-normal), then the scheduler's static shift."""
    u = torch.sigmoid(torch.randn(n, generator=generator, device=device))
    return shift * u / (1 + (shift - 1) * u)


def flow_matching_loss(
    transformer: SD3Transformer2DModel,
    latents_BCHW: torch.Tensor,
    prompt_embeds: torch.Tensor,
    pooled: torch.Tensor,
    sigmas_B: torch.Tensor,
    noise_BCHW: torch.Tensor,
) -> torch.Tensor:
    """Rectified-flow MSE: x = (1 - s) x0 + s noise, target velocity noise - x0 (the scheduler's
    Euler step x_prev = x + (s_prev - s) v integrates it), timestep = s * 1000 as the pipeline feeds it."""
    s = sigmas_B.view(-1, 1, 1, 1)
    noisy = (1 - s) * latents_BCHW + s * noise_BCHW
    pred = transformer(
        hidden_states=noisy,
        timestep=sigmas_B * 1000,
        encoder_hidden_states=prompt_embeds,
        pooled_projections=pooled,
        return_dict=False,
    )[0]
    return F.mse_loss(pred.float(), (noise_BCHW - latents_BCHW).float())


# --------------------------------------------------------------------------------- training
def lr_factor(step: int, steps: int, warmup: int, schedule: str) -> float:
    """Multiplier of the base learning rate at `step` (0-based): a linear warm-up over `warmup` steps, then
    1 ("constant") or a cosine from 1 at the warm-up's end to 0 at step `steps` ("cosine")."""
    ramp = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
    if schedule == "constant" or step < warmup:
        return ramp
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def train_vae(vae: AutoencoderKL, images: torch.Tensor, cfg: PretrainConfig) -> dict:
    """Reconstruction training (MSE on sampled latents + 1e-6 KL, so the posterior becomes nearly
    deterministic), then shift/scaling factors from the latents' mean/std. Returns metrics."""
    device = images.device
    generator = torch.Generator(device).manual_seed(cfg.seed + 1)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.vae_steps, 0, cfg.vae_lr_schedule)
    )
    vae.train()
    for step in range(cfg.vae_steps):
        x = to_model_range(images[torch.randint(len(images), (cfg.vae_batch,), generator=generator, device=device)])
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample(generator=generator)).sample
        loss = F.mse_loss(recon, x) + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % cfg.log_every == 0 or step == cfg.vae_steps - 1:
            print(f"vae step {step:5d}  loss {loss.item():.5f}", flush=True)
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        x = to_model_range(images[:512])
        latents = vae.encode(x).latent_dist.mode()
        mse = F.mse_loss(vae.decode(latents).sample.clamp(-1, 1), x).item()
    vae.register_to_config(shift_factor=latents.mean().item(), scaling_factor=1.0 / latents.std().item())
    return {
        "vae_recon_psnr_db": 10 * math.log10(4.0 / mse),
        "vae_shift_factor": vae.config.shift_factor,
        "vae_scaling_factor": vae.config.scaling_factor,
    }


def train_flow(
    pipe: StableDiffusion3Pipeline, images: torch.Tensor, ids: tuple[torch.Tensor, torch.Tensor], cfg: PretrainConfig
) -> list[float]:
    """Joint flow-matching training of transformer + both text encoders; EMA weights are copied in at
    the end. Returns the loss every step (synchronised with the GPU only every `log_every` steps).
    With `max_seconds` > 0 it stops at the first log point past that much training time (the summary
    records the steps done; rerunning with `--steps` set to them reproduces the run)."""
    device = images.device
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    params = [p for m in modules for p in m.train().parameters()]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.steps, cfg.warmup, cfg.lr_schedule)
    )
    ema = [p.detach().clone() for p in params]
    generator = torch.Generator(device).manual_seed(cfg.seed + 2)
    empty = [tokenize(tok, [""]).to(device) for tok in (pipe.tokenizer, pipe.tokenizer_2)]  # CFG's negative
    shift, scale = pipe.vae.config.shift_factor, pipe.vae.config.scaling_factor
    zero_tokens = cfg.zero_token_counts
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    for step in range(cfg.steps):
        index = torch.randint(len(images), (cfg.batch_size,), generator=generator, device=device)
        with torch.no_grad():
            latents = (pipe.vae.encode(to_model_range(images[index])).latent_dist.mode() - shift) * scale
        drop = torch.rand(cfg.batch_size, 1, generator=generator, device=device) < cfg.caption_dropout
        ids_l, ids_g = (torch.where(drop, e, i[index]) for e, i in zip(empty, ids))
        sigmas = logit_normal_sigmas(cfg.batch_size, cfg.shift, generator, device)
        noise = torch.randn(latents.shape, generator=generator, device=device)
        with autocast:
            prompt_embeds, pooled = encode_text(pipe, ids_l, ids_g, zero_tokens[step % len(zero_tokens)])
            loss = flow_matching_loss(pipe.transformer, latents, prompt_embeds, pooled, sigmas, noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        decay = min(cfg.ema_decay, (1 + step) / (10 + step))  # short memory early, while weights move fast
        torch._foreach_lerp_(ema, [p.detach() for p in params], 1.0 - decay)
        losses.append(loss.detach())
        if (step + 1) % cfg.log_every == 0 or step == cfg.steps - 1:
            recent = torch.stack(losses[-cfg.log_every :]).mean().item()
            rate = (step + 1) / (time.perf_counter() - start)
            print(f"step {step + 1:6d}/{cfg.steps}  loss {recent:.4f}  {rate:.2f} steps/s", flush=True)
            if cfg.max_seconds and time.perf_counter() - start > cfg.max_seconds:
                print(f"stopping after {step + 1} steps: --max-seconds {cfg.max_seconds:g} reached", flush=True)
                break
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    for m in modules:
        m.eval().requires_grad_(False)
    return [x.item() for x in losses]


# ------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(pipe: StableDiffusion3Pipeline, dataset: PromptDataset, cfg: PretrainConfig, batch: int = 64) -> dict:
    """Strict accuracy and mean geneval_lite score of ODE samples (the diffusers pipeline itself, prompt
    i with seed cfg.seed + i), overall and per tag."""
    reward = build_reward("geneval_lite")
    records = dataset.records[: cfg.eval_prompts or len(dataset)]
    device = pipe.transformer.device
    scores, accuracy, tags = [], [], []
    for start in range(0, len(records), batch):
        chunk = records[start : start + batch]
        generators = [torch.Generator(device).manual_seed(cfg.seed + start + i) for i in range(len(chunk))]
        images = pipe(
            prompt=[r.prompt for r in chunk],
            num_inference_steps=cfg.eval_steps,
            guidance_scale=cfg.guidance_scale,
            height=IMAGE_SIZE,
            width=IMAGE_SIZE,
            generator=generators,
            output_type="np",
        ).images
        out = reward(
            (images * 255).round().astype(np.uint8),
            [r.prompt for r in chunk],
            [{"ground_truth": r.ground_truth, **r.metadata} for r in chunk],
        )
        scores += out.scores.tolist()
        accuracy += out.info["accuracy"]
        tags += [r.metadata["tag"] for r in chunk]
    result = {"num_prompts": len(records), "accuracy": float(np.mean(accuracy)), "reward": float(np.mean(scores))}
    for tag in TAGS:
        chosen = [a for a, t in zip(accuracy, tags) if t == tag]
        if chosen:
            result[f"accuracy/{tag}"] = float(np.mean(chosen))
    return result


def folder_megabytes(path: str) -> float:
    """Total size of the .safetensors files under path, in MB (10^6 bytes)."""
    return (
        sum(
            os.path.getsize(os.path.join(root, f))
            for root, _, files in os.walk(path)
            for f in files
            if f.endswith(".safetensors")
        )
        / 1e6
    )


def run(cfg: PretrainConfig) -> dict:
    """The whole recipe: data, VAE, flow training, save, evaluate; returns (and writes) the summary."""
    device = torch.device(cfg.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    begin = time.perf_counter()
    pipe = build_pipeline(cfg).to(device)
    images_np, captions = make_dataset(cfg.num_images, cfg.seed, cfg.workers)
    images = torch.from_numpy(images_np).to(device)
    longest = max(len(ids) for ids in pipe.tokenizer(sorted(set(captions))).input_ids)
    if longest > cfg.text_tokens:
        raise ValueError(
            f"--text-tokens {cfg.text_tokens} would cut captions of up to {longest} tokens; give at least {longest}"
        )
    ids = tuple(tokenize(tok, captions).to(device) for tok in (pipe.tokenizer, pipe.tokenizer_2))
    data_s = time.perf_counter() - begin
    print(f"data: {len(captions)} scenes in {data_s:.1f} s", flush=True)
    vae_metrics = train_vae(pipe.vae, images, cfg)
    vae_s = time.perf_counter() - begin - data_s
    losses = train_flow(pipe, images, ids, cfg)
    train_s = time.perf_counter() - begin - data_s - vae_s
    pipe.save_pretrained(cfg.out, safe_serialization=True)
    heldout = PromptDataset.load(cfg.heldout)
    evaluation = evaluate(pipe, heldout, cfg)
    summary = {
        "steps": len(losses),
        "first_loss": float(np.mean(losses[: min(10, len(losses))])),
        "final_loss": float(np.mean(losses[-min(100, len(losses)) :])),
        **vae_metrics,
        "heldout": os.path.relpath(cfg.heldout),
        **{f"eval/{k}": v for k, v in evaluation.items()},
        "seconds": {"data": data_s, "vae": vae_s, "train": train_s, "total": time.perf_counter() - begin},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "safetensors_mb": folder_megabytes(cfg.out),
        "parameters": {
            name: sum(p.numel() for p in getattr(pipe, name).parameters())
            for name in ("transformer", "text_encoder", "text_encoder_2", "vae")
        },
        "config": asdict(cfg),
    }
    with open(os.path.join(cfg.out, "pretrain_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2), flush=True)
    return summary


def parse_args(argv: list[str] | None = None) -> PretrainConfig:
    """CLI flags: one per PretrainConfig field (--out required)."""
    parser = argparse.ArgumentParser(
        prog="python -m diffrl.shapes.pretrain.sd3",
        description="Pretrain the reference shapes model (docs/reference-model.md).",
    )
    defaults = PretrainConfig(out="", device="cpu")
    for field in fields(PretrainConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.name == "out":
            parser.add_argument(flag, required=True, help="output diffusers folder")
        else:
            default = getattr(defaults, field.name) if field.name != "device" else "cuda"
            parser.add_argument(flag, type=type(default), default=default, help=f"default {default}")
    return PretrainConfig(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    run(parse_args())
