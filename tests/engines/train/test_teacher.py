"""diffrl.engines.train.teacher: a teacher with a LoRA file fused in computes what the base with that LoRA active
computes (peft's own forward), and a teacher that cannot stand in for the policy's denoiser is one clear error; the
LoRA file is found as a prompt file is (diffrl.flows.build.teacher_lora_file)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from peft import LoraConfig, get_peft_model_state_dict

from diffrl.engines.train.checkpoint import LORA_FILE, save_diffusers_lora
from diffrl.engines.train.teacher import load_teacher
from diffrl.flows.build import PACKAGE_DIR, REFERENCE_DIR, teacher_lora_file
from diffrl.models.base import load_adapter


def _forward(transformer, seed: int = 0) -> torch.Tensor:
    cfg = transformer.config
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, cfg.in_channels, 16, 16, generator=g)
    text = torch.randn(2, 5, cfg.joint_attention_dim, generator=g)
    pooled = torch.randn(2, cfg.pooled_projection_dim, generator=g)
    with torch.no_grad():
        return transformer(latents, text, pooled, torch.tensor([500.0, 250.0]), return_dict=False)[0]


def test_a_lora_teacher_is_the_base_with_that_lora(tiny_model, tmp_path):
    path = tiny_model("sd3")
    base = load_adapter(path)  # the policy too: the teacher is checked against its architecture and shapes only
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=["to_q"])
    base.transformer.add_adapter(config)
    for name, p in base.transformer.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # peft starts B at 0: make the LoRA change the output
    # written as `diffrl export` writes a run's LoRA: diffusers' file, the LoraConfig (alpha: the scale) in its metadata
    save_diffusers_lora(
        type(base.pipe), str(tmp_path), {"transformer": get_peft_model_state_dict(base.transformer)}, config.to_dict()
    )
    lora = os.path.join(tmp_path, LORA_FILE)
    expected = _forward(base.transformer)
    teacher = load_teacher(path, base, lora=lora, dtype=torch.float32)
    assert not any(p.requires_grad for p in teacher.parameters())
    torch.testing.assert_close(_forward(teacher), expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(_forward(load_teacher(path, base, dtype=torch.float32)), expected, atol=1e-3)


def test_a_teacher_that_cannot_replace_the_policy_is_refused(tiny_model, tmp_path):
    student = load_adapter(tiny_model("sd3"))
    with pytest.raises(ValueError, match="is a 'flux' model, the policy a 'sd3' one"):
        load_teacher(tiny_model("flux"), student, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"other shapes than the policy .*'in_channels': \(4, 16\)"):
        load_teacher(os.path.join(REFERENCE_DIR, "shapes-small"), student, dtype=torch.float32)
    with pytest.raises(ValueError, match="teacher_lora .* must be an existing .safetensors file"):
        load_teacher(tiny_model("sd3"), student, lora=str(tmp_path / "adapter.bin"), dtype=torch.float32)


def test_a_relative_teacher_lora_names_the_shipped_file_from_any_directory(tmp_path, monkeypatch):
    shipped = "models/reference/shapes/transformer/diffusion_pytorch_model.safetensors"  # any file shipped with diffrl
    monkeypatch.chdir(tmp_path)
    assert teacher_lora_file(shipped) == os.path.join(PACKAGE_DIR, shipped)
    os.makedirs(os.path.dirname(shipped))
    open(shipped, "wb").close()
    assert teacher_lora_file(shipped) == shipped  # a file at the path itself comes first


def test_a_teacher_lora_that_is_nowhere_names_the_paths_tried(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tried = f"{tmp_path}/teacher/missing.safetensors and {PACKAGE_DIR}/teacher/missing.safetensors"
    with pytest.raises(ValueError, match=re.escape(f"'teacher/missing.safetensors': no such file (tried {tried})")):
        teacher_lora_file("teacher/missing.safetensors")
    with pytest.raises(ValueError, match=re.escape(f"no such file (tried {tmp_path}/gone.safetensors);")):
        teacher_lora_file(str(tmp_path / "gone.safetensors"))


def test_a_teacher_with_another_vae_latent_space_is_refused():
    """The shipped shapes and shapes-small models share their denoiser's shapes (4 latent channels) but not their VAE
    (other scale and shift, one downsampling block against two): the same image is other latents, so the teacher's
    velocities would not be the policy's targets."""
    student = load_adapter(os.path.join(REFERENCE_DIR, "shapes"))
    with pytest.raises(ValueError, match=r"another VAE latent space than the policy .*'downsampling_blocks': \(2, 1\)"):
        load_teacher(os.path.join(REFERENCE_DIR, "shapes-small"), student, dtype=torch.float32)
    assert load_teacher(os.path.join(REFERENCE_DIR, "shapes"), student, dtype=torch.float32) is not None
