"""Shared pieces of the GPU benchmarks: real-size pipelines with random weights, and measurement helpers.

Compute does not depend on weight values, so a pipeline built from the published configs with random
weights costs what the real one costs. Text encoders are left out (text encoding is excluded from the
figures): the engines read random prompt embeddings of the real shapes through their persistent
embedding-cache path (`PrecomputedEmbeddings`), exactly as a run does once its prompts are cached.

The published configs of the two pipelines come from their model folders (diffrl/models/sd3/realsize.py,
diffrl/models/qwen_image/realsize.py).

Legend: B batch, T text tokens, D text hidden size, P pooled size.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import time
from typing import Callable

import torch

from diffrl.models.qwen_image.realsize import QWEN_IMAGE_SCHEDULER, QWEN_IMAGE_TRANSFORMER
from diffrl.models.sd3.realsize import SD35M_SCHEDULER, SD35M_TRANSFORMER, SD35M_VAE

QWEN_VAE: dict = {}  # Qwen/Qwen-Image vae/config.json equals AutoencoderKLQwenImage's defaults

# --tiny: the same classes at smoke-test size (numbers are meaningless).
TINY_SD3 = dict(
    SD35M_TRANSFORMER,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=32,
    caption_projection_dim=16,
    pooled_projection_dim=24,
    sample_size=32,
    pos_embed_max_size=64,
    dual_attention_layers=(0,),
)
TINY_SD3_VAE = dict(SD35M_VAE, block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=4)
TINY_QWEN = dict(
    QWEN_IMAGE_TRANSFORMER,
    num_layers=2,
    num_attention_heads=2,
    attention_head_dim=16,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
)
TINY_QWEN_VAE = dict(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1)


def build_adapter(arch: str, *, tiny: bool, device: str, dtype: torch.dtype):
    """A ModelAdapter ("sd3" or "qwen_image") over a pipeline without text encoders, random weights, on `device`.

    Weights are initialised directly on the device in `dtype` (a 20 B model in fp32 on the host would
    take minutes and 80 GB); the VAE is built in fp32 and cast.
    """
    from diffusers import (
        AutoencoderKL,
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    from diffrl.models.qwen_image.adapter import QwenImageAdapter
    from diffrl.models.sd3.adapter import SD3Adapter

    if arch not in ("sd3", "qwen_image"):
        raise ValueError(f"arch must be one of ['sd3', 'qwen_image']; got {arch!r}")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    with torch.device(device):
        torch.set_default_dtype(dtype)
        try:
            transformer = (
                SD3Transformer2DModel(**(TINY_SD3 if tiny else SD35M_TRANSFORMER))
                if arch == "sd3"
                else QwenImageTransformer2DModel(**(TINY_QWEN if tiny else QWEN_IMAGE_TRANSFORMER))
            )
        finally:
            torch.set_default_dtype(previous)
        if arch == "sd3":
            vae = AutoencoderKL(**(TINY_SD3_VAE if tiny else SD35M_VAE))
        else:
            vae = AutoencoderKLQwenImage(**(TINY_QWEN_VAE if tiny else QWEN_VAE))
    vae.to(dtype=dtype)
    if arch == "sd3":
        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(**SD35M_SCHEDULER),
            vae=vae,
            text_encoder=None,
            tokenizer=None,
            text_encoder_2=None,
            tokenizer_2=None,
            text_encoder_3=None,
            tokenizer_3=None,
        )
        adapter = SD3Adapter(pipe, device=device, dtype=dtype)
    else:
        pipe = QwenImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
            vae=vae,
            text_encoder=None,
            tokenizer=None,
            transformer=transformer,
        )
        adapter = QwenImageAdapter(pipe, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    adapter.source = f"random-{arch}{'-tiny' if tiny else ''}"
    return adapter


def random_encoding(adapter, tokens: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One prompt's encoding (batch of 1) with the real shapes of `adapter`'s text side, random values.

    SD3: {"prompt_embeds": (1, T, D), "pooled_prompt_embeds": (1, P)}; Qwen-Image: {"prompt_embeds":
    (1, T, D), "prompt_embeds_mask": (1, T) all ones} (what encode_prompt returns for a T-token prompt).
    """
    cfg = adapter.transformer.config
    embeds = torch.randn(1, tokens, cfg.joint_attention_dim, generator=generator)
    if adapter.arch == "sd3":
        pooled = torch.randn(1, cfg.pooled_projection_dim, generator=generator)
        out = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
    else:
        out = {"prompt_embeds": embeds, "prompt_embeds_mask": torch.ones(1, tokens, dtype=torch.long)}
    return {k: v.to(adapter.device, adapter.dtype if v.is_floating_point() else v.dtype) for k, v in out.items()}


class PrecomputedEmbeddings:
    """A prompt-embedding cache (RolloutEngine's EmbeddingCacheLike) that already holds every prompt."""

    def __init__(self, table: dict[str, dict[str, torch.Tensor]]):
        self.table = table

    def get(self, fingerprint: str, prompts: list[str]) -> dict:
        return {p: self.table[p] for p in prompts}

    def put(self, fingerprint: str, encodings: dict) -> None:
        raise ValueError(
            f"prompts {sorted(encodings)[:3]} have no precomputed embedding: the benchmark does not "
            "encode text; add them to the table"
        )


def device_slug(device: str) -> str:
    """Short device name for file names: "h200" for "NVIDIA H200", "h100" for "NVIDIA H100 80GB HBM3", "cpu"."""
    if not device.startswith("cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower().replace("nvidia", "").strip()
    return re.sub(r"[^a-z0-9]+", "_", name.split()[0]) if name else "gpu"


def write_json(path: str | None, result: dict) -> None:
    """Write `result` to `path` whole or not at all (a .tmp file, then a rename), so a benchmark that rewrites its
    record as it goes leaves a readable file when it is stopped; None: write nothing."""
    if path is None:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(path + ".tmp", path)


def record_steps(engines, cfg, result: dict, out: str | None, keep: Callable[[dict], dict], summary) -> None:
    """Run cfg.run.steps RL steps through the step core (engines only); after each, `keep(metrics)` (plus the GPU's
    peak memory) is appended to result["steps"], `summary(steps)` merged into `result`, and the result written to
    `out` (so a run stopped early keeps the steps it ran)."""
    from diffrl.engines.step.run import DirectStages, StepClock, add_perf, run_step

    stages, clock = DirectStages(engines), StepClock()
    for step in range(cfg.run.steps):
        kept = keep(add_perf(run_step(engines, step, stages).metrics, clock.lap()))
        if torch.cuda.is_available() and cfg.model.device != "cpu":
            kept["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["steps"].append(kept)
        result.update(summary(result["steps"]))
        write_json(out, result)
        print(f"step {step + 1}: {kept}", flush=True)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_median(fn: Callable[[], object], *, repeats: int, warmup: int, device: str) -> float:
    """Median wall seconds of fn() after `warmup` untimed calls (synchronised on CUDA)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def forward_flops(fn: Callable[[], object]) -> int:
    """FLOPs of one call of fn() as torch.utils.flop_counter counts them (matmuls, convs, SDPA)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def matmul_tflops(device: str, size: int = 8192, repeats: int = 10) -> float | None:
    """Measured bf16 matrix-product rate (TFLOP/s) of one size^3 product on random data; None on CPU."""
    if not device.startswith("cuda"):
        return None
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    seconds = time_median(lambda: a @ b, repeats=repeats, warmup=3, device=device)
    return 2 * size**3 / seconds / 1e12


def set_checkpointing(transformer, fraction: float) -> None:
    """Activation checkpointing of the first round(fraction x blocks) transformer blocks (0 = off, 1 = all).

    Selective checkpointing keeps the other blocks' activations: it trades memory for the recompute of
    only the checkpointed blocks (full checkpointing re-runs every block's forward in the backward).
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"checkpointing fraction must be in [0, 1]; got {fraction}")
    if fraction == 0.0:
        transformer.disable_gradient_checkpointing()
        return
    blocks = list(transformer.transformer_blocks)
    chosen = {id(b) for b in blocks[: round(fraction * len(blocks))]}
    full = torch.utils.checkpoint.checkpoint

    def checkpoint_some(block, *args, **kwargs):
        if id(block) in chosen:
            return full(block.__call__, *args, use_reentrant=False, **kwargs)
        return block(*args, **kwargs)

    transformer.enable_gradient_checkpointing(checkpoint_some)


SDPA_BACKENDS = ("default", "flash", "efficient", "cudnn", "math")


@contextlib.contextmanager
def sdpa_backend(name: str):
    """Within it, F.scaled_dot_product_attention may use only backend `name` ("default": PyTorch chooses).

    Probes use it to find out which backend supports which inputs. Timed runs set the product's own
    preference instead (`adapter.attention`, the `model.attention` setting), which falls back to the
    other backends for inputs the preferred one does not support."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name not in SDPA_BACKENDS:
        raise ValueError(f"sdpa backend must be one of {list(SDPA_BACKENDS)}; got {name!r}")
    if name == "default":
        yield
        return
    backend = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]
    with sdpa_kernel([backend]):
        yield
