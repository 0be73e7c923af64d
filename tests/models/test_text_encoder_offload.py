"""`model.offload_text_encoder`: text encoders kept in host memory, lent to the device only to encode new prompts.

The CI machine has no GPU: the device here is the CPU, where `HostResident.on` still makes a separate copy of every
weight (what it does on a GPU), so the tests see the swap: other storage inside the block, the host copy after it.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from diffrl.configs.rollout import SamplingConfig
from diffrl.engines.rollout.engine import RolloutEngine
from diffrl.models.base import load_adapter
from diffrl.models.offload import HostResident

SD3_TEXT_ENCODERS = ["text_encoder", "text_encoder_2", "text_encoder_3"]


def _frozen_mlp() -> nn.Module:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)).requires_grad_(False)
    mlp.register_buffer("scale", torch.tensor(2.0))
    return mlp


def _storage(module: nn.Module) -> list[int]:
    return [t.data_ptr() for t in [*module.parameters(), *module.buffers()]]


def test_weights_visit_the_device_inside_the_block_and_come_back_after_it():
    mlp = _frozen_mlp()
    x = torch.randn(3, 4)
    want = mlp(x) * mlp.scale
    resident = HostResident("mlp", mlp)
    assert resident.bytes == sum(t.numel() * 4 for t in [*mlp.parameters(), *mlp.buffers()])
    home = _storage(mlp)
    with resident.on(torch.device("cpu")) as lent:
        assert lent is mlp
        inside = _storage(mlp)
        assert not set(inside) & set(home)  # a separate copy of every weight: the GPU's, on a GPU
        assert torch.equal(mlp(x) * mlp.scale, want)
    assert _storage(mlp) == home and resident.trips == 1
    assert torch.equal(mlp(x) * mlp.scale, want)


def test_a_trainable_module_is_refused():
    with pytest.raises(ValueError, match="encoder has trainable weights: only frozen modules"):
        HostResident("encoder", nn.Linear(2, 2))


def _sampling() -> SamplingConfig:
    return SamplingConfig(height=64, width=64, num_inference_steps=2, guidance_scale=4.5, negative_prompt="")


def test_offloaded_encoders_encode_as_resident_ones_and_visit_only_for_new_prompts(tiny_model):
    path = tiny_model("sd3")
    resident = RolloutEngine(load_adapter(path), progress=False)
    adapter = load_adapter(path, offload_text_encoder=True)
    offloaded = RolloutEngine(adapter, progress=False)
    assert [r.name for r in adapter.host_resident] == SD3_TEXT_ENCODERS
    home = [_storage(r.module) for r in adapter.host_resident]
    cfg = _sampling()
    # the first batch: one visit for its prompts, one for the negative prompt; then one per batch with a new prompt
    for prompts, trips in ((["a red square", "a blue circle"], 2), (["a blue circle"], 2), (["two stars"], 3)):
        want, got = resident.encode(prompts, cfg), offloaded.encode(prompts, cfg)
        for a, b in zip(want[:2], got[:2]):  # the positive and the negative batch
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert [r.trips for r in adapter.host_resident] == [trips] * 3  # a cached prompt needs no visit
        assert [_storage(r.module) for r in adapter.host_resident] == home  # between encodings: the host copy


def test_a_random_folder_builds_the_same_weights_with_its_text_encoders_on_the_host(tiny_model, tmp_path):
    """`random:<folder>` builds each text encoder on the device and moves it to the host before the next component:
    the same weights as a build that keeps it, and the denoiser still on the run's device."""
    folder = tmp_path / "configs"
    shutil.copytree(tiny_model("sd3"), folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    kept = load_adapter(f"random:{folder}")
    moved = load_adapter(f"random:{folder}", offload_text_encoder=True)
    for name in SD3_TEXT_ENCODERS + ["transformer", "vae"]:
        a, b = getattr(kept.pipe, name).state_dict(), getattr(moved.pipe, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert {p.device.type for p in moved.transformer.parameters()} == {"cpu"}
    assert [r.name for r in moved.host_resident] == SD3_TEXT_ENCODERS


def test_a_model_without_a_separate_text_encoder_says_so(tiny_model):
    with pytest.raises(ValueError, match="model.offload_text_encoder: bagel has no separate text encoder"):
        load_adapter(tiny_model("bagel"), offload_text_encoder=True)
