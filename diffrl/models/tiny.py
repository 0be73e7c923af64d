"""Offline tiny models: every supported architecture at tiny size with random weights, saved as an ordinary model
folder (a diffusers pipeline, a causal LM, BAGEL's or HunyuanImage-3.0's own layout) that loads with no network.

Each architecture's builders live in its folder (diffrl/models/<arch>/tiny.py), registered with `register_tiny`;
tokenizers are built in memory (diffrl/models/tokenizers.py) so nothing is downloaded. Deterministic for a seed.

The cache: `cached_tiny(arch, root, seed)` builds a tiny model once and every later caller, in any process, gets the
same complete folder. Three things make it safe when several processes ask at once (the engine replicas of one run,
each a Ray actor):
- a file lock per folder: one process builds, the others wait and then find the folder;
- the build goes into a fresh temporary folder next to the final one and is renamed into place (one atomic
  `os.replace`), so a folder under the final name is always complete, also after a build that was killed;
- a process that is a non-zero rank of a torch.distributed group builds in a child process: transformers'
  `save_pretrained` writes nothing (no config, no weights) on a rank other than 0 of an initialised group, which
  left empty text_encoder folders in the cache when replica 1 took the lock first.
The built folder is checked before the rename (each part it names holds files, each model config has weights), so
a builder that wrote too little is an error, never a cached folder.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Callable

from diffrl import registry
from diffrl.models.kind import folder_kind

log = logging.getLogger("diffrl")
WEIGHTS = (".safetensors", ".bin", ".safetensors.index.json")


def register_tiny(arch: str) -> Callable:
    """Decorator: `fn(out_dir, seed)` builds and saves the tiny model of `arch` into out_dir (diffrl.registry)."""
    return registry.register("tiny", arch)


def tiny_architectures() -> list[str]:
    return registry.names("tiny")


def build_tiny(arch: str, out_dir: str, *, seed: int = 0) -> str:
    """Build the tiny `arch` model with random weights (seeded) and save it to out_dir."""
    build = registry.get("tiny", arch).obj
    os.makedirs(out_dir, exist_ok=True)
    build(out_dir, seed)
    return out_dir


def cached_tiny(arch: str, root: str, *, seed: int = 0) -> str:
    """The folder `root/<arch>-seed<seed>` of the tiny `arch` model, built on first use (file-locked, atomic)."""
    out = os.path.join(root, f"{arch}-seed{seed}")
    if folder_kind(out) is not None:  # model_index.json (diffusers) or config.json (a causal LM)
        return out
    os.makedirs(root, exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two processes building the same tiny model wait for one
        if folder_kind(out) is None:
            tmp = tempfile.mkdtemp(prefix=f".{arch}-seed{seed}.", suffix=".tmp", dir=root)
            try:
                log.info("building tiny %s model in %s", arch, out)
                _build(arch, tmp, seed)
                missing = missing_parts(tmp)
                if missing:
                    raise RuntimeError(f"the tiny {arch!r} builder wrote an incomplete folder: missing {missing}")
                shutil.rmtree(out, ignore_errors=True)  # an unusable leftover (no index file) under the final name
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def _build(arch: str, out_dir: str, seed: int) -> None:
    """build_tiny here, or in a child process where this one is a non-zero torch.distributed rank."""
    if not _nonzero_rank():
        build_tiny(arch, out_dir, seed=seed)
        return
    # a builder registered in this process (a plug-in's) registers in the child when its module is imported; the
    # built-in ones register on the child's first lookup (importing them all here would only cost time)
    entry = registry.registered("tiny").get(arch)
    module = entry.obj.__module__ if entry is not None else "diffrl.models.tiny"
    code = (
        "import importlib, sys; importlib.import_module(sys.argv[1]); from diffrl.models.tiny import build_tiny; "
        "build_tiny(sys.argv[2], sys.argv[3], seed=int(sys.argv[4]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, module, arch, out_dir, str(seed)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny {arch!r} model in a child process failed:\n{done.stderr[-4000:]}")


def _nonzero_rank() -> bool:
    """Whether this process is a rank other than 0 of an initialised torch.distributed group."""
    if "torch" not in sys.modules:  # nothing imported torch: no group can be initialised
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


def missing_parts(folder: str) -> list[str]:
    """What a saved model folder lacks: the parts model_index.json names with no files, and each folder with a model
    config.json but no weights file. Empty for a complete folder (a diffusers pipeline, a causal LM, BAGEL's)."""
    missing = []
    index = os.path.join(folder, "model_index.json")
    if os.path.isfile(index):
        with open(index) as f:
            parts = [name for name, value in json.load(f).items() if isinstance(value, list) and value[0] is not None]
        missing += [name for name in parts if not os.path.isdir(p := os.path.join(folder, name)) or not os.listdir(p)]
    for sub, _, files in os.walk(folder):
        if "config.json" in files and not any(f.endswith(WEIGHTS) for f in files):
            missing.append(os.path.relpath(os.path.join(sub, "model weights"), folder))
    if folder_kind(folder) is None:
        missing.append("model_index.json or config.json")
    return sorted(missing)
