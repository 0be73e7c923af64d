"""The model and the settings of the shapes reference pretraining (diffrl/shapes/pretrain/sd3.py, whose docstring
describes the recipe): `PretrainConfig` (the CLI flags) and the untrained SD3-layout pipeline it builds.

Legend: S image side (64), C latent channels (4).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from diffrl.models.tokenizers import clip_tokenizer, t5_tokenizer

IMAGE_SIZE = 64
LATENT_CHANNELS = 4
ZERO_TOKENS = "32,96,256"  # T5-slot lengths cycled in training: 32 holds every caption, 256 is the default
SCHEDULES = ("constant", "cosine")  # learning rate after warm-up: held, or a cosine to 0 over the run's steps
HELDOUT = os.path.join(os.path.dirname(__file__), "..", "..", "data", "shapes_heldout.jsonl")


@dataclass
class PretrainConfig:
    """All knobs of one pretraining run (the CLI flags, --snake-case)."""

    out: str
    steps: int = 6500
    device: str = "cuda"
    seed: int = 0
    batch_size: int = 256
    lr: float = 7e-4
    warmup: int = 200
    lr_schedule: str = "constant"
    width: int = 128
    layers: int = 8
    patch_size: int = 4
    vae_levels: int = 1
    text_tokens: int = 77
    zero_tokens: str = ZERO_TOKENS
    text_width: int = 64
    text_layers: int = 3
    num_images: int = 100_000
    vae_steps: int = 1500
    vae_batch: int = 64
    vae_lr_schedule: str = "constant"
    caption_dropout: float = 0.1
    ema_decay: float = 0.999
    shift: float = 3.0
    eval_prompts: int = 0
    eval_steps: int = 10
    guidance_scale: float = 4.5
    workers: int = 0
    log_every: int = 100
    max_seconds: float = 0.0
    heldout: str = HELDOUT

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
        for name in (
            "steps",
            "batch_size",
            "width",
            "layers",
            "text_width",
            "text_layers",
            "num_images",
            "eval_steps",
            "log_every",
            "vae_batch",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.width % 32 or self.text_width % 16:
            raise ValueError(
                f"--width must be a multiple of 32 (heads of 32) and --text-width of 16; "
                f"got {self.width}, {self.text_width}"
            )
        if self.vae_levels not in (1, 2, 3):
            raise ValueError(
                f"--vae-levels must be 1, 2 or 3 (latents {IMAGE_SIZE}, 32 or 16 a side), got {self.vae_levels}"
            )
        if self.patch_size not in (1, 2, 4, 8) or self.patch_size > self.latent_size:
            raise ValueError(
                f"--patch-size must be 1, 2, 4 or 8 and at most the latent side {self.latent_size}, "
                f"got {self.patch_size}"
            )
        if not 8 <= self.text_tokens <= 77:
            raise ValueError(f"--text-tokens must be in [8, 77] (CLIP's length), got {self.text_tokens}")
        if not self.zero_token_counts or min(self.zero_token_counts) < 1 or max(self.zero_token_counts) > 512:
            raise ValueError(f"--zero-tokens must be comma-separated lengths in [1, 512], got {self.zero_tokens!r}")
        for name in ("lr_schedule", "vae_lr_schedule"):
            if getattr(self, name) not in SCHEDULES:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be one of {', '.join(SCHEDULES)}, got {getattr(self, name)!r}"
                )
        if self.max_seconds < 0:
            raise ValueError(f"--max-seconds must be >= 0 (0: no limit), got {self.max_seconds}")
        if not 0 <= self.caption_dropout < 1 or not 0 <= self.ema_decay < 1:
            raise ValueError("--caption-dropout and --ema-decay must be in [0, 1)")

    @property
    def latent_size(self) -> int:
        """Latent side: the VAE halves the image side at each level after the first."""
        return IMAGE_SIZE // 2 ** (self.vae_levels - 1)

    @property
    def zero_token_counts(self) -> tuple[int, ...]:
        """--zero-tokens as integers ((): not a comma-separated list of integers)."""
        try:
            return tuple(int(x) for x in self.zero_tokens.split(","))
        except ValueError:
            return ()


# ------------------------------------------------------------------------------------ model
def small_clip(tokenizer, cfg: PretrainConfig, hidden_act: str) -> CLIPTextModelWithProjection:
    """A CLIP text encoder with projection, `text_layers` deep (the pipeline reads hidden_states[-2])."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.text_width,
        intermediate_size=4 * cfg.text_width,
        num_hidden_layers=cfg.text_layers,
        num_attention_heads=cfg.text_width // 16,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=cfg.text_width,
        hidden_act=hidden_act,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config)


def zero_t5(tokenizer, d_model: int) -> T5EncoderModel:
    """A one-layer T5 encoder whose output is exactly zero (final RMS norm weight 0), frozen: it fills the
    pipeline's T5 slot with zeros, whatever the prompt and length."""
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=d_model,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=0,
    )
    model = T5EncoderModel(config)
    with torch.no_grad():
        model.encoder.final_layer_norm.weight.zero_()
    return model.requires_grad_(False)


def build_pipeline(cfg: PretrainConfig) -> StableDiffusion3Pipeline:
    """The untrained pipeline (seeded random weights), SD3 layout at reference size."""
    torch.manual_seed(cfg.seed)
    tokenizer, tokenizer_2 = clip_tokenizer(), clip_tokenizer(pad_token="!")  # SD3's two pad conventions
    for tok in (tokenizer, tokenizer_2):
        tok.model_max_length = cfg.text_tokens  # saved with the tokenizer; the pipeline pads CLIP to it
    tokenizer_3 = t5_tokenizer()
    joint = 2 * cfg.text_width  # CLIP-L and CLIP-G hidden states side by side, as in SD3
    transformer = SD3Transformer2DModel(
        sample_size=cfg.latent_size,
        patch_size=cfg.patch_size,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_layers=cfg.layers,
        attention_head_dim=32,
        num_attention_heads=cfg.width // 32,
        joint_attention_dim=joint,
        caption_projection_dim=cfg.width,
        pooled_projection_dim=joint,
        pos_embed_max_size=cfg.latent_size // cfg.patch_size,
        qk_norm="rms_norm",
    )
    # One level by default: no down-sampling; each further level halves the side (widths 32, 64, 64).
    # No mid-block attention either way (4096 positions would dominate the cost).
    levels = cfg.vae_levels
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=LATENT_CHANNELS,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=(32, 64, 64)[:levels],
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=IMAGE_SIZE,
        mid_block_add_attention=False,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0,
        scaling_factor=1.0,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=cfg.shift),
        vae=vae,
        text_encoder=small_clip(tokenizer, cfg, "quick_gelu"),
        tokenizer=tokenizer,
        text_encoder_2=small_clip(tokenizer_2, cfg, "gelu"),
        tokenizer_2=tokenizer_2,
        text_encoder_3=zero_t5(tokenizer_3, joint),
        tokenizer_3=tokenizer_3,
    )
