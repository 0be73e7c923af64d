"""A diffusers pipeline built from a folder of configs with random weights, in memory on its device.

`model.path: random:<folder>` names such a folder: model_index.json, each model component's config
(`config.json`), tokenizers and the scheduler, and no weight files (`diffrl random-model ARCH DIR --configs-only`
writes one for SD3.5-Medium or Qwen-Image at real size in a second). The pipeline then has the real checkpoint's
shapes and costs its real compute, without the disk a written random checkpoint takes (Qwen-Image: ~58 GB in bf16
against the GPU machine's 64 GB disk) or the minutes it takes to write and read; vLLM's `load_format="dummy"` does
the same for its models.

Each model component is built on `device` in `dtype` by its own initialisation (PyTorch's layer defaults for the
diffusers models, transformers' `_init_weights` for the text encoders), seeded per component: every process that
builds the folder (a resumed run, each replica) gets the same weights on the same kind of device. Unlike
`from_pretrained(dtype=...)`, modules a class keeps in fp32 when loading (`_keep_in_fp32_modules`) are in `dtype`
too. Tokenizers, schedulers and processors load from their subfolders as usual.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import os
from collections.abc import Callable

import torch
from torch import nn

SEED = 0  # the weights of a `random:` folder: the same in every process


def random_pipeline(
    pipeline_cls: type,
    folder: str,
    *,
    device,
    dtype: torch.dtype,
    seed: int = SEED,
    components: dict | None = None,
    host: Callable[[str], bool] | None = None,
):
    """`pipeline_cls` with the components model_index.json in `folder` lists: models built from their configs with
    random weights on `device` in `dtype`, the rest loaded (`components`: given ones, used as they are); the
    pipeline's own config values there (Wan2.2's boundary_ratio) passed to its constructor, as `from_pretrained`
    passes them. ValueError when the folder holds weight files (it would not be what those weights say) or a model
    component has no config. `host(name)` true: that component moves to host memory once built (on `device`, so the
    weights are those a run without it builds), before the next is built."""
    with open(os.path.join(folder, "model_index.json")) as f:
        index = json.load(f)
    takes = set(inspect.signature(pipeline_cls.__init__).parameters) - {"self"}
    given = dict(components or {})
    # e.g. boundary_ratio: without it a Wan2.2 folder would load as one expert
    components = {k: v for k, v in index.items() if k in takes and not isinstance(v, list)}
    names = sorted(k for k, v in index.items() if not k.startswith("_") and isinstance(v, list))
    for i, name in enumerate(names):
        if name in given:
            components[name] = given[name]
            continue
        library, class_name = index[name]
        if library is None or class_name is None:  # an optional component the pipeline has none of
            components[name] = None
            continue
        cls = _component_class(folder, name, library, class_name)
        sub = os.path.join(folder, name)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            components[name] = _random_module(cls, library, sub, device=device, dtype=dtype, seed=seed * 100 + i)
            if host is not None and host(name):
                components[name].to("cpu")
        else:
            components[name] = cls.from_pretrained(sub)
    return pipeline_cls(**components)


# The libraries whose classes a pipeline folder may name, as diffusers loads them (its LOADABLE_CLASSES, less
# onnxruntime), and the pipeline modules of diffusers (LTX-2's connectors and vocoder live in
# diffusers.pipelines.ltx2, which its folders name "ltx2"). Any other name would make us import that module: plain
# diffusers refuses such a folder.
LIBRARIES = ("diffusers", "transformers")


def _library_module(library) -> str | None:
    """The module a model_index.json library names: diffusers, transformers or one of diffusers' pipeline packages
    (found, never imported, here); None for anything else."""
    if library in LIBRARIES:
        return library
    if isinstance(library, str) and library.isidentifier():
        pipelines = importlib.util.find_spec("diffusers.pipelines")
        if pipelines and os.path.isdir(os.path.join(list(pipelines.submodule_search_locations)[0], library)):
            return f"diffusers.pipelines.{library}"
    return None


def _component_class(folder: str, name: str, library, class_name) -> type:
    """The class model_index.json in `folder` names for component `name`: an attribute of diffusers, transformers or
    a diffusers pipeline package, never another module imported because the folder names it (ValueError naming the
    component otherwise)."""
    where = f"{os.path.join(folder, 'model_index.json')}: component {name!r}"
    module = _library_module(library)
    if module is None:
        raise ValueError(
            f"{where} names library {library!r}; a `random:` folder's components come from {' or '.join(LIBRARIES)} "
            "or a diffusers pipeline package"
        )
    cls = getattr(importlib.import_module(module), str(class_name), None) if isinstance(class_name, str) else None
    if not isinstance(cls, type):
        raise ValueError(f"{where} names {class_name!r}, which is no class of {library}")
    return cls


def _random_module(cls: type, library: str, sub: str, *, device, dtype: torch.dtype, seed: int) -> nn.Module:
    weights = (
        [f for f in os.listdir(sub) if f.endswith((".safetensors", ".bin", ".pt", ".pth"))]
        if os.path.isdir(sub)
        else []
    )
    if weights:
        raise ValueError(
            f"{sub!r} holds weight files ({', '.join(sorted(weights)[:3])}): a `random:` model path names a folder "
            "of configs only (diffrl random-model ARCH DIR --configs-only); load this one without the prefix"
        )
    if not os.path.isfile(os.path.join(sub, "config.json")):
        raise ValueError(f"{sub!r} has no config.json: cannot build its {cls.__name__} with random weights")
    with seeded(seed, device), default_dtype(dtype), torch.device(device):
        if library == "transformers":
            model = cls(cls.config_class.from_pretrained(sub))
        else:
            model = cls.from_config(cls.load_config(sub))
    # Buffers the constructors make in fp32 on purpose (SD3's sin-cos table) follow `dtype`, as in a saved folder.
    return nn.Module.to(model, dtype).eval()


@contextlib.contextmanager
def seeded(seed: int, device):
    """Seed the module inits (the CPU generator and `device`'s) without touching the caller's RNG state."""
    device = torch.device(device)
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to `dtype` inside the block (new parameters are made in it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
