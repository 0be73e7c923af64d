"""Pretrain the Janus shapes reference: a small transformers `JanusForConditionalGeneration` taught, on the CPU, to
draw the procedural shape scenes (diffrl/shapes/scenes.py) from their captions, so that GRPO on its image
tokens (tests/configs/janus_shapes_grpo.yaml) has a real, undertrained model to improve.

    python -m diffrl.shapes.pretrain.janus --out diffrl/models/reference/shapes-janus --seed 0

Two stages, as Janus-Pro's generation path is built (Chen et al., 2025; the VQ tokenizer is LlamaGen's, Sun et al.,
2024, "Autoregressive Model Beats Diffusion"):
1. VQ-VAE (`JanusVQVAE`: 64x64 images, three down-samplings, 8x8 = 64 tokens from a `--codebook`-entry codebook):
   reconstruction of scenes. As LlamaGen (and transformers' `get_codebook_entry`, which the decoder path uses),
   encoder outputs and codebook entries are l2-normalised and matched by cosine similarity; loss = pixel MSE weighted
   up on the objects (`--fg-weight`: the scenes are mostly white) + codebook + 0.25 x commitment terms, straight-
   through gradients. Deviations: no perceptual or GAN loss; codebook entries unused for `--restart-every` steps are
   re-seeded from the batch's encoder outputs (dead-code restart), since a 512-entry codebook collapses otherwise;
   training runs on random `--vq-crop` crops (the VQ is convolutional; 4x cheaper on the CPU).
2. Language model (Llama, `--layers` x `--hidden`): teacher-forced cross-entropy of the 64 image tokens of a scene
   after Janus' generation prompt (diffrl/models/janus/policy.py renders it), through the generation embeddings, aligner
   and head. A caption is dropped `--caption-dropout` of the time into exactly the unconditional row the policy samples
   with (every token but BOS and begin-of-image replaced by pad), so classifier-free guidance works.
Then greedy sampling (CFG `--guidance-scale`) of the held-out prompts, scored by geneval_lite's strict accuracy per
category, as `JanusImagePolicy` samples for validation. Stopped early on purpose (RL needs room).
Outputs: the Janus folder (safetensors, `--save-dtype`) and OUT/pretrain_summary.json.

Legend: N scenes, B batch, P prompt tokens (left-padded), T image tokens (64), E codebook dim, K codebook size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import JanusConfig, JanusForConditionalGeneration

from diffrl.engines.reward.base import build_reward
from diffrl.engines.store.prompts import PromptDataset
from diffrl.models.causal_lm.policy import SamplingParams, TokenPrompt
from diffrl.models.janus.policy import JanusImagePolicy
from diffrl.models.janus.tiny import JANUS_SPECIALS, janus_generation_config, janus_tokenizer, save_janus_folder
from diffrl.shapes.scenes import TAGS, scene_pairs, target_json

IMAGE_SIZE = 64
GRID = 8  # image tokens per side: 64 per image
TRAIN_SEED = 5_003  # the pretraining scenes (RL runs draw prompts with run.seed; the held-out set is seed 90210)
HELDOUT = os.path.join(os.path.dirname(__file__), "..", "..", "data", "shapes_heldout.jsonl")
SAVE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@dataclass
class JanusPretrainConfig:
    """All knobs of one pretraining run (the CLI flags, --snake-case)."""

    seed: int = 0
    threads: int = 1  # on the shared 2-core CPU under load, 2 threads ran 4-10x slower than 1 (measured)
    num_images: int = 20_000
    codebook: int = 512
    embed_dim: int = 8
    vq_steps: int = 800
    vq_batch: int = 32
    vq_crop: int = 32
    vq_lr: float = 2e-3
    fg_weight: float = 10.0
    restart_every: int = 50
    restart_until: float = 0.5  # dead-code restarts stop after this fraction of vq_steps (the codebook then settles)
    hidden: int = 128
    layers: int = 3
    lm_steps: int = 600
    lm_batch: int = 64
    lm_lr: float = 2e-3
    warmup: int = 50
    caption_dropout: float = 0.1
    guidance_scale: float = 5.0
    eval_prompts: int = 204
    ceiling_scenes: int = 204  # fresh scenes through the VQ-VAE: the accuracy its tokens allow at most
    log_every: int = 100
    save_dtype: str = "fp32"
    heldout: str = HELDOUT

    def __post_init__(self) -> None:
        for name in (
            "threads",
            "num_images",
            "codebook",
            "embed_dim",
            "vq_batch",
            "hidden",
            "layers",
            "lm_batch",
            "log_every",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(self, name)}")
        if self.vq_crop % 8 or not 8 <= self.vq_crop <= IMAGE_SIZE or self.hidden % 32:
            raise ValueError(
                f"--vq-crop must be a multiple of 8 in [8, {IMAGE_SIZE}] and --hidden a multiple of 32; "
                f"got {self.vq_crop}, {self.hidden}"
            )
        if not 0 <= self.caption_dropout < 1:
            raise ValueError(f"--caption-dropout must be in [0, 1); got {self.caption_dropout}")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"--save-dtype must be one of {list(SAVE_DTYPES)}; got {self.save_dtype!r}")


def shapes_janus_config(tokenizer, cfg: JanusPretrainConfig) -> JanusConfig:
    """JanusConfig of the reference: Llama `layers` x `hidden`, 64x64 images as 8x8 tokens of a `codebook`-entry
    VQ-VAE (32 channels at every level, one down-sampling conv per level and no encoder res-blocks: cheap on a CPU)."""
    text = {
        "model_type": "llama",
        "vocab_size": len(tokenizer),
        "hidden_size": cfg.hidden,
        "intermediate_size": 3 * cfg.hidden,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.hidden // 32,
        "num_key_value_heads": cfg.hidden // 32,
        "max_position_embeddings": 256,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }
    vision = {  # the understanding path: unused by image generation, kept tiny
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": IMAGE_SIZE,
        "patch_size": IMAGE_SIZE // GRID,
        "mlp_ratio": 2.0,
        "projection_dim": cfg.hidden,
        "depth": 2,
        "num_image_tokens": GRID * GRID,
    }
    vq = {
        "embed_dim": cfg.embed_dim,
        "num_embeddings": cfg.codebook,
        "latent_channels": 32,
        "base_channels": 32,  # GroupNorm(32) needs multiples of 32
        "channel_multiplier": [1, 1, 1, 1],  # 4 levels: 3 down-samplings, 64 -> 8
        "num_res_blocks": 0,  # encoder: stride-2 convs only; decoder: one res-block per level
        "projection_dim": cfg.hidden,
        "image_token_embed_dim": cfg.hidden,
        "num_hidden_layers": 2,
    }
    return JanusConfig(
        text_config=text,
        vision_config=vision,
        vq_config=vq,
        image_token_id=tokenizer.convert_tokens_to_ids(JANUS_SPECIALS["image_token"]),
    )


# ------------------------------------------------------------------------------------ stage 1: the VQ-VAE
def to_pixels(images_NHW3: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, 3) -> float (N, 3, H, W) in [-1, 1] (Janus' image processor: mean 0.5, std 0.5)."""
    return torch.from_numpy(images_NHW3).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def quantize(vq, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normalised encoder outputs z (B, E, h, w), codebook entries q (B, E, h, w), indices (B, h*w)): nearest
    l2-normalised codebook entry by cosine similarity, as transformers' decode path normalises its entries."""
    z = F.normalize(vq.quant_conv(vq.encoder(pixels)), dim=1)
    codebook = F.normalize(vq.quantize.embedding.weight, dim=-1)  # (K, E)
    b, e, h, w = z.shape
    indices = (z.permute(0, 2, 3, 1).reshape(-1, e) @ codebook.T).argmax(-1)
    q = codebook[indices].view(b, h, w, e).permute(0, 3, 1, 2)
    return z, q, indices.view(b, h * w)


def vq_loss(vq, pixels: torch.Tensor, fg_weight: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(loss, indices (B, h*w), metrics): object-weighted pixel MSE + codebook + 0.25 commitment (straight-through)."""
    z, q, indices = quantize(vq, pixels)
    recon = vq.decoder(vq.post_quant_conv(z + (q - z).detach()))
    weight = 1.0 + fg_weight * (pixels < 0.96).any(1, keepdim=True).float()  # a pixel off white is an object's
    mse = (weight * (recon - pixels) ** 2).mean() / weight.mean()
    codebook_term = F.mse_loss(q, z.detach()) + 0.25 * F.mse_loss(z, q.detach())
    return mse + codebook_term, indices, {"mse": float(mse.detach()), "codebook": float(codebook_term.detach())}


def restart_dead_codes(vq, pixels: torch.Tensor, used: torch.Tensor, generator: torch.Generator) -> int:
    """Re-seed codebook entries not used since the last restart with random encoder outputs of this batch."""
    dead = (~used).nonzero().squeeze(-1)
    if dead.numel() == 0:
        return 0
    with torch.no_grad():
        z = F.normalize(vq.quant_conv(vq.encoder(pixels)), dim=1).permute(0, 2, 3, 1).reshape(-1, vq.config.embed_dim)
        picks = torch.randint(0, z.shape[0], (dead.numel(),), generator=generator)
        vq.quantize.embedding.weight[dead] = z[picks]
    return int(dead.numel())


def random_crops(images: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """One random size x size crop per image (B, 3, size, size), at multiples of 8 pixels (token cells)."""
    if size == images.shape[-1]:
        return images
    cells = (images.shape[-1] - size) // 8 + 1
    ys, xs = (torch.randint(0, cells, (len(images),), generator=generator) * 8 for _ in range(2))
    return torch.stack([im[:, y : y + size, x : x + size] for im, y, x in zip(images, ys.tolist(), xs.tolist())])


def train_vq(vq, pixels: torch.Tensor, cfg: JanusPretrainConfig) -> dict:
    """`vq_steps` AdamW steps on random crops of random scenes; returns first/last loss and restarts."""
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(vq.parameters(), lr=cfg.vq_lr, weight_decay=0.0)
    used = torch.zeros(cfg.codebook, dtype=torch.bool)
    history, restarts = [], 0
    vq.train()
    for step in range(cfg.vq_steps):
        for group in optimizer.param_groups:
            group["lr"] = cfg.vq_lr * min(1.0, (step + 1) / cfg.warmup)
        batch = random_crops(
            pixels[torch.randint(0, len(pixels), (cfg.vq_batch,), generator=generator)], cfg.vq_crop, generator
        )
        loss, indices, metrics = vq_loss(vq, batch, cfg.fg_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        used[indices.flatten()] = True
        if cfg.restart_every and (step + 1) % cfg.restart_every == 0 and step + 1 < cfg.restart_until * cfg.vq_steps:
            restarts += restart_dead_codes(vq, batch, used, generator)
            used[:] = False
        history.append(metrics["mse"])
        if (step + 1) % cfg.log_every == 0:
            print(f"vq step {step + 1}: weighted mse {np.mean(history[-cfg.log_every :]):.4f}", flush=True)
    vq.eval()
    return {"first_mse": history[0], "final_mse": float(np.mean(history[-20:])), "codes_restarted": restarts}


@torch.no_grad()
def encode_scenes(vq, pixels: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """Image tokens (N, T) of full 64x64 scenes."""
    return torch.cat([quantize(vq, pixels[i : i + batch])[2] for i in range(0, len(pixels), batch)])


# ------------------------------------------------------------------------------------ stage 2: the language model
def image_token_loss(policy: JanusImagePolicy, captions: list[str], tokens_BT: torch.Tensor, drop: torch.Tensor):
    """Teacher-forced cross-entropy of the image tokens after the generation prompt; rows where `drop` is true get
    the unconditional prompt the policy's CFG branch uses (same length and attention mask, pads for the caption)."""
    inputs = policy.encode([TokenPrompt(c) for c in captions])
    ids = torch.where(drop[:, None], policy.unconditional_ids(inputs.input_ids), inputs.input_ids)
    model, (b, t) = policy.model, tokens_BT.shape
    embeds = torch.cat(
        [model.get_input_embeddings()(ids), model.prepare_embeddings_for_image_generation(tokens_BT[:, :-1])], 1
    )
    mask = torch.cat([inputs.attention_mask, inputs.attention_mask.new_ones((b, t - 1))], 1)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # as the policy counts them: left pads do not shift positions
    hidden = model.model.language_model(
        inputs_embeds=embeds, attention_mask=mask, position_ids=positions
    ).last_hidden_state
    logits = model.model.generation_head(hidden[:, ids.shape[1] - 1 :])  # (B, T, K): the states before each token
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens_BT.reshape(-1))


def train_lm(policy: JanusImagePolicy, captions: list[str], tokens: torch.Tensor, cfg: JanusPretrainConfig) -> dict:
    """`lm_steps` AdamW steps (warm-up then cosine to 10 %) of image-token cross-entropy; the VQ-VAE stays frozen."""
    model = policy.model
    params = [p for n, p in model.named_parameters() if not n.startswith(("model.vqmodel.", "model.vision_model."))]
    optimizer = torch.optim.AdamW(params, lr=cfg.lm_lr, weight_decay=0.0)
    rng, generator = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed + 1)
    history = []
    model.train()
    for step in range(cfg.lm_steps):
        progress = step / max(1, cfg.lm_steps)
        factor = min(1.0, (step + 1) / cfg.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = cfg.lm_lr * factor
        rows = [rng.randrange(len(captions)) for _ in range(cfg.lm_batch)]
        drop = torch.rand(cfg.lm_batch, generator=generator) < cfg.caption_dropout
        loss = image_token_loss(policy, [captions[i] for i in rows], tokens[rows], drop)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        history.append(float(loss.detach()))
        if (step + 1) % cfg.log_every == 0:
            print(f"lm step {step + 1}: cross-entropy {np.mean(history[-cfg.log_every :]):.4f}", flush=True)
    model.eval()
    return {"first_loss": history[0], "final_loss": float(np.mean(history[-20:]))}


# ------------------------------------------------------------------------------------ evaluation
def accuracy_by_tag(images, records, batch: int = 256) -> dict:
    """geneval_lite strict accuracy (overall and per tag) and mean score of uint8 images (N, H, W, 3)."""
    reward = build_reward("geneval_lite")
    scores, accuracy = [], []
    for i in range(0, len(records), batch):
        out = reward(
            images[i : i + batch],
            [r.prompt for r in records[i : i + batch]],
            [r.metadata for r in records[i : i + batch]],
        )
        scores += out.scores.tolist()
        accuracy += out.info["accuracy"]
    result = {"num_prompts": len(records), "accuracy": float(np.mean(accuracy)), "reward": float(np.mean(scores))}
    tags = [r.metadata["tag"] for r in records]
    for tag in TAGS:
        chosen = [a for a, t in zip(accuracy, tags) if t == tag]
        if chosen:
            result[f"accuracy/{tag}"] = float(np.mean(chosen))
    return result


@torch.no_grad()
def evaluate(policy: JanusImagePolicy, records, *, temperature: float = 0.0, seed: int = 0, batch: int = 64) -> dict:
    """Held-out accuracy of the policy's samples (temperature 0: greedy with CFG, as `diffrl train` validates)."""
    images = []
    for i in range(0, len(records), batch):
        params = SamplingParams(n=1, max_tokens=policy.num_image_tokens, temperature=temperature, seed=seed + i)
        images.append(policy.sample([TokenPrompt(r.prompt) for r in records[i : i + batch]], params).images)
    return accuracy_by_tag(torch.cat(images).numpy(), records)


def vq_ceiling(policy: JanusImagePolicy, n: int = 204, seed: int = 77) -> dict:
    """geneval_lite strict accuracy of fresh scenes through the VQ-VAE (encode, then the policy's decode): the most
    the language model can reach with this tokenizer."""
    images, captions, targets = scene_pairs(n, seed, IMAGE_SIZE)
    tokens = encode_scenes(policy.model.model.vqmodel, to_pixels(images))
    decoded = policy.decode(tokens).numpy()
    reward = build_reward("geneval_lite")
    meta = [{"ground_truth": target_json(t)} for t in targets]
    exact = reward(images, captions, meta).info["accuracy"]
    return {
        "accuracy": float(np.mean(reward(decoded, captions, meta).info["accuracy"])),
        "exact_renders": float(np.mean(exact)),
    }


# ------------------------------------------------------------------------------------ the run
def pretrain(cfg: JanusPretrainConfig, out_dir: str) -> dict:
    """Build, train (VQ-VAE, then the language model), save and evaluate the reference into `out_dir`."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    timings, started = {}, time.time()
    tokenizer = janus_tokenizer()
    model = JanusForConditionalGeneration(shapes_janus_config(tokenizer, cfg)).eval()
    model.generation_config = janus_generation_config(tokenizer, model, cfg.guidance_scale)
    policy = JanusImagePolicy(model, tokenizer, guidance_scale=cfg.guidance_scale, source="pretrain")
    images, captions, _ = scene_pairs(cfg.num_images, TRAIN_SEED + cfg.seed, IMAGE_SIZE)
    pixels = to_pixels(images)
    timings["data"] = time.time() - started
    vq_stats = train_vq(model.model.vqmodel, pixels, cfg)
    timings["vq"] = time.time() - started - sum(timings.values())
    tokens = encode_scenes(model.model.vqmodel, pixels)
    ceiling = vq_ceiling(policy, cfg.ceiling_scenes)
    print(f"VQ-VAE: {vq_stats}, strict accuracy of reconstructed scenes {ceiling['accuracy']:.3f}", flush=True)
    timings["encode"] = time.time() - started - sum(timings.values())
    lm_stats = train_lm(policy, captions, tokens, cfg)
    timings["lm"] = time.time() - started - sum(timings.values())
    model.to(SAVE_DTYPES[cfg.save_dtype])
    save_janus_folder(out_dir, model, tokenizer, guidance_scale=cfg.guidance_scale)
    reloaded = JanusImagePolicy.from_pretrained(out_dir)  # what ships is what is measured (runs load it in fp32)
    records = PromptDataset.load(cfg.heldout).records[: cfg.eval_prompts]
    greedy = evaluate(reloaded, records)
    timings["eval"] = time.time() - started - sum(timings.values())
    summary = {
        "config": asdict(cfg),
        "train_seed": TRAIN_SEED + cfg.seed,
        "vq": vq_stats,
        "codes_used": int(tokens.unique().numel()),
        "vq_reconstruction_accuracy": ceiling,
        "lm": lm_stats,
        "heldout_greedy": greedy,
        "heldout": os.path.relpath(cfg.heldout),
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": {k: round(v, 1) for k, v in timings.items()},
        "torch": torch.__version__,
    }
    summary["seconds"]["total"] = round(time.time() - started, 1)
    with open(os.path.join(out_dir, "pretrain_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the Janus folder to write")
    for f in JanusPretrainConfig.__dataclass_fields__.values():
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    summary = pretrain(JanusPretrainConfig(**args), out)
    print(json.dumps({k: summary[k] for k in ("vq", "vq_reconstruction_accuracy", "lm", "heldout_greedy", "seconds")}))
    return summary


if __name__ == "__main__":
    main()
