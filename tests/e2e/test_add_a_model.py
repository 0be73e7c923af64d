"""Adding a model is one folder and one registry line (docs/architecture.md, "Adding a model"), checked by doing it:
a new architecture in a package folder of its own (an SD3 adapter under a new pipeline class name, and its tiny
builder) joins through `add_architecture` and trains through `diffrl train` on the CPU."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
from e2e_settings import TINY

from diffrl import models, registry
from diffrl.flows.build import cache_dir
from diffrl.flows.train import train
from diffrl.models.base import detect_architecture

ADAPTER = '''"""My SD3: the SD3 adapter under a pipeline class name of its own."""

from diffrl.models.base import register_adapter
from diffrl.models.sd3.adapter import SD3Adapter


@register_adapter
class MySD3Adapter(SD3Adapter):
    arch = "my_sd3"
    pipeline_classes = ("MySD3Pipeline",)
'''
TINY_BUILDER = '''"""My SD3 at tiny size: the tiny SD3 pipeline, its model_index.json naming MySD3Pipeline."""

import json
import os

from diffrl.models.sd3.tiny import build_sd3
from diffrl.models.tiny import register_tiny


@register_tiny("my_sd3")
def build_my_sd3(out_dir: str, seed: int) -> None:
    build_sd3(out_dir, seed)
    index = os.path.join(out_dir, "model_index.json")
    with open(index) as f:
        config = json.load(f)
    with open(index, "w") as f:
        json.dump(dict(config, _class_name="MySD3Pipeline"), f)
'''
ONE_STEP = ["model.path=tiny:my_sd3", "run.name=my-sd3", "run.steps=1", "run.checkpoint_every=1", "run.log_images=0"]


@pytest.fixture
def my_sd3(tmp_path, monkeypatch):
    """The folder `my_models/my_sd3/` (adapter.py, tiny.py) on sys.path; afterwards the registry as it was."""
    folder = tmp_path / "plugins" / "my_models" / "my_sd3"
    folder.mkdir(parents=True)
    (folder.parent / "__init__.py").write_text("")
    (folder / "__init__.py").write_text('"""My SD3."""\n')
    (folder / "adapter.py").write_text(ADAPTER)
    (folder / "tiny.py").write_text(TINY_BUILDER)
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    listed = list(models.ARCHITECTURES)
    yield "my_models.my_sd3"
    models.ARCHITECTURES[:] = listed
    models.declare_kinds()
    for kind in ("model", "tiny"):
        registry.unregister(kind, "my_sd3")
    for name in [m for m in sys.modules if m == "my_models" or m.startswith("my_models.")]:
        del sys.modules[name]


def test_a_model_in_its_own_folder_trains_after_one_registry_line(workdir, my_sd3):
    assert "my_sd3" not in registry.names("model") and "my_sd3" not in registry.names("tiny")

    models.add_architecture(my_sd3)  # the one registry line

    assert "my_sd3" in registry.names("model") and "my_sd3" in registry.names("tiny")
    result = train(config=None, overrides=TINY + ONE_STEP)
    assert result["last_step"] == 1
    folder = os.path.join(cache_dir(), "tiny", "my_sd3-seed0")
    assert detect_architecture(folder) == "my_sd3"
    with open("runs/my-sd3/checkpoints/step_1/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
