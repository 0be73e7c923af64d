"""model.attention: the SDPA backend choice around denoiser forwards (models.base.attention_context)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from models.base import ATTENTION_BACKENDS, attention_context


def test_unknown_backend_is_an_error_listing_the_choices():
    with pytest.raises(ValueError, match="one of default, cudnn, flash, efficient, math; got 'sage'"):
        attention_context("sage", torch.device("cpu"))


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_cpu_keeps_pytorchs_own_choice(backend):
    """Backend priorities are a CUDA matter: on CPU every setting leaves SDPA as it is."""
    assert isinstance(attention_context(backend, torch.device("cpu")), contextlib.nullcontext)

