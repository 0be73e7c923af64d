"""Models: one folder per architecture, each listed once in ARCHITECTURES below.

A folder `diffrl/models/<arch>/` holds everything of one architecture:
    adapter.py, adapter_*.py    its ModelAdapter (the diffusion family), registered with models.base.register_adapter
    policy.py                   or its token policy (the autoregressive family: causal_lm, janus)
    tiny.py, tiny_*.py          its offline tiny builders, registered with models.tiny.register_tiny
    realsize.py, realsize_*.py  its real-size configs; diffusers pipelines register a plan with
                                models.realsize.register_plan (`diffrl random-model`)
    anything else it needs (bagel's MoT, hunyuan_image3's MoE backbone and VAE)
The shared parts stay here: base.py (the adapter protocol, detection and loading), tiny.py (the tiny-model registry
and cache), realsize.py (writing real-size folders), random_weights.py (`random:` folders), tokenizers.py (offline
tokenizers), kind.py (diffusion or autoregressive), wav.py and reference/ (the shipped reference models).

Adding a model is its folder and one line in ARCHITECTURES. The registry kinds "model", "tiny" and "realsize" import
the folders' modules of their role on their first lookup (diffrl/registry.py), so importing diffrl stays fast:
loading an SD3 folder imports the adapters, not the autoregressive policies. An architecture outside diffrl (a
package of the same shape) joins with `add_architecture("my_package")`.
"""

from __future__ import annotations

import importlib.util
import os

from diffrl import registry

# The architecture folders (packages), in the order a model folder's model_index.json is matched against them.
ARCHITECTURES: list[str] = [
    "diffrl.models.sd3",
    "diffrl.models.flux",
    "diffrl.models.flux2",
    "diffrl.models.qwen_image",
    "diffrl.models.qwen_image21",
    "diffrl.models.z_image",
    "diffrl.models.wan",
    "diffrl.models.ltx2",
    "diffrl.models.stable_audio3",
    "diffrl.models.hunyuan_video15",
    "diffrl.models.bagel",
    "diffrl.models.hunyuan_image3",
    "diffrl.models.janus",
    "diffrl.models.causal_lm",
]
# registry kind -> (the modules of a folder that register it: <role>.py and <role>_*.py, what its errors call it)
KINDS = {
    "model": ("adapter", "model architecture"),
    "tiny": ("tiny", "tiny architecture"),
    "realsize": ("realsize", "real-size architecture"),
}


def role_modules(role: str) -> tuple[str, ...]:
    """The modules of `role` in the ARCHITECTURES folders, in list order: each folder's `<role>.py`, then its
    `<role>_*.py` by name. Found by file name, nothing imported."""
    found = []
    for package in ARCHITECTURES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"architecture {package!r} is not a package folder")
        names = sorted(os.listdir(list(spec.submodule_search_locations)[0]))
        stems = [n[:-3] for n in names if n.endswith(".py")]
        found += [f"{package}.{s}" for s in stems if s == role]
        found += [f"{package}.{s}" for s in stems if s.startswith(role + "_")]
    return tuple(found)


def declare_kinds() -> None:
    """Declare the registry kinds whose built-ins live in the architecture folders (again after ARCHITECTURES grew:
    the next lookup of each kind imports the new modules)."""
    for kind, (role, label) in KINDS.items():
        registry.declare(kind, role_modules(role), label=label)


def add_architecture(package: str) -> None:
    """Add an architecture folder from outside diffrl: `package` (importable, laid out as the folders here) is
    listed after the built-in ones, and its adapters, tiny builders and real-size plans are found on the next lookup
    like theirs."""
    if package not in ARCHITECTURES:
        ARCHITECTURES.append(package)
    declare_kinds()


declare_kinds()
