"""model.attention and model.tf32: SDPA backend choice around denoiser forwards, TF32 for CUDA fp32 matmuls."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from diffrl.models.base import ATTENTION_BACKENDS, attention_context


def test_unknown_backend_is_an_error_listing_the_choices():
    with pytest.raises(ValueError, match="one of default, cudnn, flash, efficient, math; got 'sage'"):
        attention_context("sage", torch.device("cpu"))


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_cpu_keeps_pytorchs_own_choice(backend):
    """Backend priorities are a CUDA matter: on CPU every setting leaves SDPA as it is."""
    assert isinstance(attention_context(backend, torch.device("cpu")), contextlib.nullcontext)


@pytest.mark.parametrize("enabled", [False, True])
def test_model_tf32_sets_pytorchs_cuda_flags_when_the_engines_are_built(enabled, tmp_path, tiny_model):
    """`model.tf32` (default true) reaches PyTorch's process-wide TF32 flags through build_engines; the flags
    exist without a GPU, so the CPU machine checks the wiring."""
    from diffrl.configs.schema import load_experiment
    from diffrl.engines import cluster
    from diffrl.flows.build import build_engines

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    assert load_experiment("quickstart", []).model.tf32 is True
    cfg = load_experiment(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "quick_dpo.yaml"),
        [
            f"model.path={tiny_model('sd3')}",
            f"run.root={tmp_path}/runs",
            f"run.name=tf32_{enabled}",
            f"model.tf32={str(enabled).lower()}",
            "rollout.height=32",
            "rollout.width=32",
            "data.num_generated=8",
        ],
    )
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not enabled
    try:
        build_engines(cfg)
        assert torch.backends.cuda.matmul.allow_tf32 is enabled and torch.backends.cudnn.allow_tf32 is enabled
    finally:
        cluster.drop(cfg.run.name)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
