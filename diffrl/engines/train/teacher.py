"""The teacher of an on-policy distillation (an algorithm whose needs.teacher, e.g. diffusion_opd): another model's
frozen denoiser, optionally with a LoRA merged in, that the trainer runs in place of the policy's to score the stored
states (PolicyTrainer.teacher_policy). It runs on the policy's prompt encodings, so it must be the same architecture
with the same latent and text-embedding shapes; only its denoiser is kept.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from diffrl.models.base import ModelAdapter, load_adapter

# transformer config entries that fix the shapes a denoiser reads and writes (latent channels, patches, text widths)
SHAPE_KEYS = (
    "in_channels",
    "out_channels",
    "patch_size",
    "patch_size_t",
    "joint_attention_dim",
    "pooled_projection_dim",
    "text_dim",
    "caption_channels",
    "cap_feat_dim",
)


# VAE config entries that fix the latent space the denoiser's velocities live in: channels, scale and shift (or
# per-channel statistics) and the spatial and temporal downsampling
LATENT_KEYS = (
    "latent_channels",
    "z_dim",
    "scaling_factor",
    "shift_factor",
    "latents_mean",
    "latents_std",
    "dim_mult",
    "temperal_downsample",
)


def _latent_space(adapter: ModelAdapter) -> dict:
    """The latent-space entries its VAE's config has, and its downsampling steps; {} without a VAE."""
    vae = getattr(adapter.pipe, "vae", None)
    if vae is None:
        return {}
    space = {k: vae.config[k] for k in LATENT_KEYS if k in vae.config}
    if "block_out_channels" in vae.config:
        space["downsampling_blocks"] = len(vae.config["block_out_channels"])
    return space


def load_teacher(path: str, student: ModelAdapter, *, lora: str | None = None, dtype: torch.dtype) -> nn.Module:
    """The frozen denoiser of the diffusers folder `path` (with the diffusers LoRA file `lora` fused into it), on the
    CPU: the trainer wakes it on its device for each update. ValueError, one line, when it cannot stand in for the
    student's denoiser (another architecture, other shapes) or the LoRA file is not a safetensors file."""
    if lora is not None and not (lora.endswith(".safetensors") and os.path.isfile(lora)):
        raise ValueError(f"model.teacher_lora {lora!r} must be an existing .safetensors file (diffusers LoRA weights)")
    teacher = load_adapter(path, device="cpu", dtype=dtype)
    if teacher.arch != student.arch:
        raise ValueError(
            f"model.teacher {path!r} is a {teacher.arch!r} model, the policy a {student.arch!r} one: the teacher must "
            "be the policy's architecture"
        )
    if len(student.denoisers()) > 1:
        raise ValueError(f"model.teacher: {student.arch} has {len(student.denoisers())} denoisers; one is supported")
    ours, theirs = student.transformer.config, teacher.transformer.config
    differ = {k: (theirs.get(k), ours.get(k)) for k in SHAPE_KEYS if theirs.get(k) != ours.get(k)}
    if differ:
        raise ValueError(
            f"model.teacher {path!r} has other shapes than the policy (teacher, policy): {differ}; the teacher must "
            "share the policy's latent and text-embedding shapes"
        )
    ours, theirs = _latent_space(student), _latent_space(teacher)
    differ = {
        k: (theirs.get(k), ours.get(k)) for k in sorted(ours.keys() | theirs.keys()) if theirs.get(k) != ours.get(k)
    }
    if differ:
        raise ValueError(
            f"model.teacher {path!r} has another VAE latent space than the policy (teacher, policy): {differ}; its "
            "velocities would be in other latents: the teacher must share the policy's VAE"
        )
    if lora is not None:
        teacher.pipe.load_lora_weights(os.path.dirname(os.path.abspath(lora)), weight_name=os.path.basename(lora))
        teacher.pipe.fuse_lora(components=["transformer"])
        teacher.pipe.unload_lora_weights()
    return teacher.transformer.requires_grad_(False).eval()
