"""`diffrl export --merge` for pipelines diffusers gives no LoRA loader (HunyuanVideo-1.5, Stable Audio 3): the merged
transformer's weights are the closed form W + scaling B A of the LoRA the adapter wrote, and the saved folder loads in
plain diffusers as the plain pipeline class."""

from __future__ import annotations

import json
import os

import pytest
import torch
from diffusers import DiffusionPipeline
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict

from diffrl.engines.train.export import merged_pipeline
from diffrl.models.base import load_adapter


@pytest.mark.parametrize("arch", ["hunyuan_video15", "stable_audio3"])
def test_a_lora_merges_into_a_pipeline_without_a_lora_loader(arch, tiny_model, tmp_path):
    base = tiny_model(arch)
    adapter = load_adapter(base)
    assert not hasattr(DiffusionPipeline.from_pretrained(base), "load_lora_weights")  # the case this covers
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(adapter.default_lora_targets), init_lora_weights=False)
    adapter.transformer.add_adapter(config)
    expected = {}
    for name, module in adapter.transformer.named_modules():
        if isinstance(module, LoraLayer):
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            expected[f"{name}.weight"] = module.base_layer.weight + module.scaling["default"] * (b @ a)
    assert expected
    # as a checkpoint writes it (diffrl/engines/train/checkpoint.py): the LoraConfig in the file's metadata
    adapter.pipe.save_lora_weights(
        str(tmp_path),
        transformer_lora_layers=get_peft_model_state_dict(adapter.transformer),
        transformer_lora_adapter_metadata=config.to_dict(),
    )
    pipe = merged_pipeline(base, str(tmp_path), str(tmp_path / "pytorch_lora_weights.safetensors"))
    merged = pipe.transformer.state_dict()
    assert not any("lora_" in k for k in merged)
    for key, weight in expected.items():
        torch.testing.assert_close(merged[key], weight.detach(), rtol=1e-5, atol=1e-6)
    pipe.save_pretrained(str(tmp_path / "merged"))
    with open(os.path.join(tmp_path, "merged", "transformer", "config.json")) as f:
        assert json.load(f)["_class_name"] == type(DiffusionPipeline.from_pretrained(base).transformer).__name__
    reloaded = DiffusionPipeline.from_pretrained(str(tmp_path / "merged")).transformer.state_dict()
    key = next(iter(expected))
    torch.testing.assert_close(reloaded[key], merged[key])
