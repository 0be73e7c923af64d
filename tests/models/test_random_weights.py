"""`random:<folder>` pipelines (diffrl/models/random_weights.py): which classes a folder's model_index.json may name."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from diffrl.models.random_weights import random_pipeline


def _folder(tmp_path, component: list) -> str:
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline", "vae": component}))
    return str(folder)


def test_a_folder_naming_a_module_outside_diffusers_and_transformers_is_refused_without_importing_it(
    tmp_path, monkeypatch
):
    """A folder naming a module is refused: importing it would run its code; plain diffusers refuses such a folder
    too."""
    code = tmp_path / "code"
    code.mkdir()
    marker = tmp_path / "imported"
    (code / "planted_module.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Model: pass\n")
    monkeypatch.syspath_prepend(str(code))
    folder = _folder(tmp_path, ["planted_module", "Model"])
    with pytest.raises(ValueError, match=r"component 'vae' names library 'planted_module'; a `random:` folder's"):
        random_pipeline(StableDiffusion3Pipeline, folder, device="cpu", dtype=torch.float32)
    assert not marker.exists() and "planted_module" not in sys.modules


def test_a_name_that_is_no_class_of_diffusers_is_refused(tmp_path):
    folder = _folder(tmp_path, ["diffusers", "utils"])
    with pytest.raises(ValueError, match=r"component 'vae' names 'utils', which is no class of diffusers"):
        random_pipeline(StableDiffusion3Pipeline, folder, device="cpu", dtype=torch.float32)
