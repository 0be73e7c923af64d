"""Real-size random-weight pipeline folders (`diffrl random-model`): what writes them, for every architecture whose
folder registers a plan (`register_plan`): SD3.5-Medium (diffrl/models/sd3/realsize.py), Qwen-Image
(diffrl/models/qwen_image/realsize.py), Wan2.2 T2V A14B (diffrl/models/wan/realsize.py).

Every component is built from the published config (in the architecture's realsize.py, each number with its
source), so a folder has the real checkpoint's shapes and costs the real compute, but holds random weights. It loads
with `DiffusionPipeline.from_pretrained` and `models.base.load_adapter` like the real folder, offline. Tokenizers
are built in memory (diffrl/models/tokenizers.py) with the real special tokens; every token id stays below the real
vocab size.

Writing: the parameter count of each component is taken on the meta device first and checked against
the free disk space; then ONE component at a time is initialised on `device` in `dtype` by the modules'
own init (transformers' `_init_weights` for the text encoders, PyTorch's layer defaults for the diffusers
models), saved as sharded safetensors and freed. The folder is written as OUT_DIR.tmp and renamed at the
end, model_index.json last, so a half-written folder never loads.

`weights=False` (`--configs-only`) writes the same folder without weight files: `model.path: random:<folder>` then
builds every model component from its config with random weights in memory on the run's device
(diffrl/models/random_weights.py), which Qwen-Image (~58 GB in bf16) and Wan2.2 A14B (~69 GB) need on a 64 GB disk.

`scale` (tests only) maps a component's folder name to config overrides (nested dicts merge), e.g.
{"transformer": {"num_layers": 2}}: the same code path at toy size.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from diffrl import registry
from diffrl.models.random_weights import default_dtype, seeded

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_SHARD_SIZE = "5GB"
# Tokenizers, configs and safetensors headers, on top of parameters x bytes.
DISK_MARGIN_BYTES = 256 * 2**20
_MARKER = ".diffrl-random-model-incomplete"


@dataclass(frozen=True)
class Plan:
    """What one architecture's folder holds: weights to build (folder -> constructor that initialises
    on the current default device and dtype), small objects saved as they are (tokenizers, scheduler) and the
    pipeline's own config values model_index.json carries (Wan2.2's boundary_ratio)."""

    pipeline_class: type
    models: dict[str, Callable[[], nn.Module]]
    small: dict[str, object]
    config: dict[str, object] = field(default_factory=dict)


def merged(base: dict, overrides: dict | None) -> dict:
    """base updated with overrides; nested dicts merge key by key (the `scale` hook's rule)."""
    out = dict(base)
    for key, value in (overrides or {}).items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def register_plan(arch: str) -> Callable:
    """Decorator: `fn(scale) -> Plan` describes the real-size folder of `arch` (`diffrl random-model ARCH`)."""
    return registry.register("realsize", arch)


def plan_names() -> list[str]:
    """The registered real-size architectures, in the order of their folders (diffrl/models/__init__.py)."""
    registry.load_builtins("realsize")
    order = registry.builtin_modules("realsize")
    entries = registry.registered("realsize")
    return sorted(entries, key=lambda name: _rank(order, entries[name].obj.__module__))


def _rank(order: tuple[str, ...], module: str) -> int:
    return order.index(module) if module in order else len(order)


def plan_for(arch: str, scale: dict[str, dict] | None = None) -> Plan:
    """The Plan of `arch` (one of plan_names()); ValueError listing the choices otherwise."""
    names = plan_names()
    if arch not in names:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(names)}")
    return registry.get("realsize", arch).obj(scale)


def stored_numel(model: nn.Module) -> int:
    """Elements a checkpoint of `model` stores: parameters (tied ones once) and persistent buffers
    (e.g. SD3's 384x384 positional-embedding table, 226 M values at real size)."""
    n = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        n += sum(
            b.numel()
            for name, b in module._buffers.items()
            if b is not None and name not in module._non_persistent_buffers_set
        )
    return n


def meta_counts(plan: Plan) -> dict[str, tuple[int, int]]:
    """folder -> (parameters, stored elements) of each weight component, built on the meta device."""
    counts = {}
    for name, build in plan.models.items():
        with torch.device("meta"):
            model = build()
        counts[name] = (sum(p.numel() for p in model.parameters()), stored_numel(model))
        del model
    return counts


def build_random(
    arch: str,
    out_dir: str,
    *,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    scale: dict[str, dict] | None = None,
    weights: bool = True,
) -> str:
    """Write the `arch` pipeline (one of plan_names()) with random weights to out_dir; returns out_dir.

    One component at a time: initialised on `device` in `dtype` (seeded), saved as sharded safetensors,
    freed. ValueError (nothing written) for an unknown arch, an existing out_dir, an unusable device or
    dtype, or too little free disk space for parameters x bytes per value. `weights=False` writes the configs,
    tokenizers and scheduler only (built on the meta device: no weights made, a second), for `model.path:
    random:<out_dir>`, which builds the weights in memory (diffrl/models/random_weights.py).
    """
    start = time.perf_counter()
    if arch not in plan_names():
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(plan_names())}")
    device = _usable_device(device)
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(map(str, DTYPES.values()))}; got {dtype!r}")
    out_dir = os.path.normpath(out_dir)
    if os.path.lexists(out_dir):
        raise ValueError(f"OUT_DIR {out_dir!r} already exists; remove it or choose a new folder")
    plan = plan_for(arch, scale)
    counts = meta_counts(plan)
    need = (sum(stored for _, stored in counts.values()) * _itemsize(dtype) if weights else 0) + DISK_MARGIN_BYTES
    tmp = out_dir + ".tmp"
    _remove_leftover(tmp)
    free = check_disk_space(tmp, need)
    what = f"~{need / 1e9:.1f} GB in {_dtype_name(dtype)}" if weights else "configs only, no weights"
    _progress(
        f"{arch}: {sum(n for n, _ in counts.values()):,} parameters, {what} into {tmp} ({free / 1e9:.1f} GB free)"
    )
    os.makedirs(tmp)
    open(os.path.join(tmp, _MARKER), "w").close()
    index: dict[str, object] = {}
    for i, (name, build) in enumerate(plan.models.items()):
        if weights:
            index[name] = _write_model(
                name, build, os.path.join(tmp, name), device=device, dtype=dtype, seed=seed * 100 + i
            )
        else:
            index[name] = _write_config(build, os.path.join(tmp, name), dtype=dtype)
    for name, obj in plan.small.items():
        obj.save_pretrained(os.path.join(tmp, name))
        index[name] = _library_and_class(obj)
    index.update(plan.config)
    _write_model_index(plan, index, tmp)  # last: until now the folder is not a pipeline
    os.remove(os.path.join(tmp, _MARKER))
    os.rename(tmp, out_dir)
    _progress(f"{arch}: wrote {out_dir} in {time.perf_counter() - start:.1f} s")
    return out_dir


def check_disk_space(path: str, need: int) -> int:
    """Free bytes on the filesystem that will hold `path`; ValueError when fewer than `need`."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    if free < need:
        raise ValueError(
            f"not enough disk space for {path!r}: the folder needs ~{need / 1e9:.1f} GB ({need:,} bytes = "
            f"parameters x bytes per value + {DISK_MARGIN_BYTES // 2**20} MiB), but {probe!r} has "
            f"{free / 1e9:.1f} GB ({free:,} bytes) free; --configs-only writes the configs alone (a few MB) for "
            "model.path=random:OUT_DIR, which builds the weights in memory"
        )
    return free


def _write_model(
    name: str, build: Callable[[], nn.Module], path: str, *, device: torch.device, dtype: torch.dtype, seed: int
) -> list[str]:
    """Initialise one component on device in dtype, save it sharded, free it; its model_index entry."""
    start = time.perf_counter()
    with seeded(seed, device), default_dtype(dtype), device:
        model = build()
    # Buffers the constructors make in fp32 on purpose (SD3's sin-cos table) are stored in dtype as well.
    # nn.Module.to: diffusers' ModelMixin.to warns about fp32-kept modules, which these models have none of.
    model = nn.Module.to(model, dtype).eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    built = time.perf_counter()
    entry = _library_and_class(model)
    kwargs = {"safe_serialization": True} if entry[0] != "transformers" else {}  # transformers 5: always
    model.save_pretrained(path, max_shard_size=MAX_SHARD_SIZE, **kwargs)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _progress(
        f"{name} ({entry[1]}): {parameters:,} parameters, init {built - start:.1f} s, "
        f"save {time.perf_counter() - built:.1f} s"
    )
    return entry


def _write_config(build: Callable[[], nn.Module], path: str, *, dtype: torch.dtype) -> list[str]:
    """One component's config alone (the model built on the meta device); its model_index entry."""
    with default_dtype(dtype), torch.device("meta"):
        model = build()
    entry = _library_and_class(model)
    if entry[0] != "transformers":  # diffusers, or one of its pipeline modules
        model.save_config(path)
    else:
        model.config.save_pretrained(path)
    return entry


def _write_model_index(plan: Plan, index: dict[str, object], folder: str) -> None:
    """model_index.json as `DiffusionPipeline.save_pretrained` writes it (absent optional parts: [null, null])."""
    import diffusers

    cls = plan.pipeline_class
    expected = set(inspect.signature(cls.__init__).parameters) - {"self"}
    optional = set(cls._optional_components)
    assert set(index) <= expected and expected - optional <= set(index), f"{cls.__name__} takes {sorted(expected)}"
    full = {"_class_name": cls.__name__, "_diffusers_version": diffusers.__version__, **index}
    for name in optional - set(index):
        full[name] = [None, None]
    with open(os.path.join(folder, "model_index.json"), "w") as f:
        f.write(json.dumps(full, indent=2, sort_keys=True) + "\n")


def _library_and_class(obj: object) -> list[str]:
    """["diffusers" | "transformers" | a diffusers pipeline module, class name]: a model_index.json entry. A class
    defined in a pipeline's own module (LTX-2's connectors and vocoder) is written under that module's name ("ltx2"),
    as diffusers' `register_modules` writes it. A subclass defined elsewhere (diffrl's processors without a video
    processor) is written as the library class it extends, as released folders name it."""
    for cls in type(obj).__mro__:
        path = cls.__module__.split(".")
        if path[:2] == ["diffusers", "pipelines"] and len(path) > 3:
            return [path[2], cls.__name__]
        if path[0] in ("diffusers", "transformers"):
            return [path[0], cls.__name__]
    return [type(obj).__module__.split(".")[0], type(obj).__name__]


def _usable_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device {str(device)!r} is not a torch device (use cuda, cuda:N or cpu): {err}") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda, cuda:N or cpu; got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: CUDA is not available here; use a GPU machine or device cpu")
    return device


def _remove_leftover(tmp: str) -> None:
    """Remove a previous interrupted write (it carries our marker file); refuse any other folder."""
    if not os.path.lexists(tmp):
        return
    if not os.path.isfile(os.path.join(tmp, _MARKER)):
        raise ValueError(f"{tmp!r} exists and is not an interrupted `diffrl random-model` write; remove it")
    shutil.rmtree(tmp)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def _progress(message: str) -> None:
    print(f"diffrl random-model: {message}", file=sys.stderr, flush=True)
