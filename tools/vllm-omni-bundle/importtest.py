"""Import vllm-omni's text-to-image path from the unpacked bundles and say where each top-level module came from.

usage: PYTHONPATH=OMNI_SITE:VLLM_SITE python3.12 importtest.py [module ...]

Imports what benchmarks/vllm_omni_rollout.py's child imports (vllm_omni, Omni, OmniDiffusionSamplingParams), the
diffusion engine, executor, worker and model runner that Omni starts, and the SD3.5 and Qwen-Image pipelines with
their post-processing (vllm_omni/diffusion/registry.py:24,169,485,515), plus any modules named on the command line.
Prints `OK` or `FAIL` for each, then the third-party top-level modules loaded from each PYTHONPATH entry and from the
interpreter's site-packages (the image stand-in), so a package the bundle left out shows up as a failure here.
"""

import importlib
import os
import sys
import time
import traceback

MODULES = [
    "vllm_omni",
    "vllm_omni.entrypoints.omni",
    "vllm_omni.inputs.data",
    "vllm_omni.diffusion.diffusion_engine",
    "vllm_omni.diffusion.registry",
    "vllm_omni.diffusion.executor.multiproc_executor",
    "vllm_omni.diffusion.worker.diffusion_worker",
    "vllm_omni.diffusion.worker.diffusion_model_runner",
    "vllm_omni.diffusion.model_loader.diffusers_loader",
    "vllm_omni.diffusion.attention.backends.utils.fa",
    "vllm_omni.diffusion.cache.cache_dit_backend",
    "vllm_omni.platforms.cuda.platform",
    "vllm_omni.diffusion.models.sd3.pipeline_sd3",
    "vllm_omni.diffusion.models.sd3.sd3_transformer",
    "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image",
    "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit",
    "vllm_omni.diffusion.models.qwen_image.qwen_image_transformer",
    "vllm_omni.diffusion.models.qwen_image.autoencoder_kl_qwenimage",
]
VERSIONS = ["vllm_omni", "vllm", "diffusers", "accelerate", "transformers", "torch", "numpy", "pydantic"]


def origin_groups(paths: list[str]) -> dict[str, set[str]]:
    """Top-level module names grouped by the PYTHONPATH entry (or 'image') their files come from."""
    groups: dict[str, set[str]] = {p: set() for p in paths}
    groups["image"] = set()
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None) or ""
        top = name.split(".")[0]
        where = next((p for p in paths if path.startswith(p)), "image" if "site-packages" in path else None)
        if where is not None:
            groups[where].add(top)
    return groups


def main() -> None:
    began = time.time()
    failed = 0
    for name in MODULES + sys.argv[1:]:
        try:
            importlib.import_module(name)
            print(f"OK   {name}")
        except BaseException as e:  # record every failure, keep going
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            print("     " + traceback.format_exc().strip().splitlines()[-3].strip())
    from vllm_omni.entrypoints.omni import Omni  # noqa: F401
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams  # noqa: F401

    for name in VERSIONS:
        mod = sys.modules.get(name) or importlib.import_module(name)
        print(f"version {name} {getattr(mod, '__version__', '?')} {os.path.dirname(mod.__file__ or '')}")
    print(f"{len(MODULES) + len(sys.argv) - 1 - failed} imported, {failed} failed, {time.time() - began:.1f} s")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    for where, tops in origin_groups(paths).items():
        print(f"from {where}: {' '.join(sorted(tops))}")


if __name__ == "__main__":
    main()
