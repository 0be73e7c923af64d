"""Shared pieces of the GPU benchmarks: real-size pipelines with random weights, and measurement helpers.

Compute does not depend on weight values, so a pipeline built from the published configs with random
weights costs what the real one costs. `random_model_folder` writes the configs-only folder `diffrl random-model ARCH
DIR --configs-only` writes, less its text encoders, and `model.path: random:DIR` builds it through the product's loader
(build_engines). Text encoding is excluded from the figures: the engines read random prompt embeddings of the real
shapes through their persistent embedding-cache path (`RandomEmbeddings`), exactly as a run does once its prompts are
cached.

Legend: B batch, T text tokens, D text hidden size, P pooled size.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import tempfile
import time
import zlib
from typing import Callable

import torch

from diffrl.models.kind import RANDOM

PLANS = {"sd3": "sd35m", "qwen_image": "qwen_image"}  # adapter arch -> `diffrl random-model` plan
# --tiny: the same classes at smoke-test size (numbers are meaningless); the widths the pipeline joins still agree
TINY_SCALES = {
    "sd3": {
        "transformer": dict(
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=32,
            caption_projection_dim=16,
            pooled_projection_dim=24,
            sample_size=32,
            pos_embed_max_size=64,
            dual_attention_layers=(0,),
        ),
        "vae": dict(block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=4),
        # configs only (their folders are dropped): sized so that the plan's width checks pass
        "text_encoder": dict(
            hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, projection_dim=12
        ),
        "text_encoder_2": dict(
            hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, projection_dim=12
        ),
        "text_encoder_3": dict(
            d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, relative_attention_num_buckets=8
        ),
    },
    "qwen_image": {
        "transformer": dict(
            num_layers=2, num_attention_heads=2, attention_head_dim=16, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)
        ),
        "vae": dict(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
        "text_encoder": {
            "text_config": dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                rope_parameters=dict(mrope_section=[2, 3, 3]),
            ),
            "vision_config": dict(
                depth=1,
                hidden_size=16,
                intermediate_size=16,
                num_heads=2,
                out_hidden_size=32,
                fullatt_block_indexes=[0],
            ),
        },
    },
}


def random_model_folder(arch: str, out_dir: str, *, tiny: bool) -> str:
    """A configs-only pipeline folder of `arch` ("sd3": SD3.5-Medium, "qwen_image": Qwen-Image) at real size (or tiny)
    without its text encoders, for `model.path: random:<out_dir>`; returns out_dir.

    It is what `diffrl random-model PLAN OUT_DIR --configs-only` writes (diffrl/models/realsize.py), with each text
    encoder an absent component: the benchmarks read random prompt embeddings instead (`RandomEmbeddings`)."""
    from diffrl.models.realsize import build_random

    if arch not in PLANS:
        raise ValueError(f"arch must be one of {sorted(PLANS)}; got {arch!r}")
    build_random(PLANS[arch], out_dir, device="cpu", weights=False, scale=TINY_SCALES[arch] if tiny else None)
    index_path = os.path.join(out_dir, "model_index.json")
    with open(index_path) as f:
        index = json.load(f)
    for name in [k for k in index if k.startswith("text_encoder")]:
        index[name] = [None, None]
        shutil.rmtree(os.path.join(out_dir, name))
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return out_dir


def build_adapter(arch: str, *, tiny: bool, device: str, dtype: torch.dtype):
    """A ModelAdapter ("sd3" or "qwen_image") over a pipeline without text encoders, random weights, on `device`,
    loaded as a run loads `model.path: random:<folder>` (the weights are initialised on the device in `dtype`)."""
    from diffrl.models.base import load_adapter

    folder = random_model_folder(arch, os.path.join(tempfile.mkdtemp(prefix=f"random_{arch}_"), "model"), tiny=tiny)
    return load_adapter(RANDOM + folder, device=device, dtype=dtype)


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


class RandomEmbeddings:
    """A prompt-embedding cache (RolloutEngine's EmbeddingCacheLike) that holds an encoding of every prompt: random
    values of `adapter`'s real text shapes, `tokens` tokens (`tokens_of[prompt]` for the prompts it names, e.g. the
    negative prompt), the same for the same prompt and seed."""

    def __init__(self, adapter, tokens: int, tokens_of: dict[str, int] | None = None, seed: int = 1):
        self.adapter, self.tokens, self.tokens_of, self.seed = adapter, tokens, dict(tokens_of or {}), seed
        self.table: dict[str, dict[str, torch.Tensor]] = {}

    def encoding(self, prompt: str) -> dict[str, torch.Tensor]:
        if prompt not in self.table:
            generator = torch.Generator().manual_seed(self.seed * 2**32 + zlib.crc32(prompt.encode()))
            tokens = self.tokens_of.get(prompt, self.tokens)
            self.table[prompt] = random_encoding(self.adapter, tokens, generator)
        return self.table[prompt]

    def get(self, fingerprint: str, prompts: list[str]) -> dict:
        return {p: self.encoding(p) for p in prompts}

    def put(self, fingerprint: str, encodings: dict) -> None:
        raise ValueError(f"prompts {sorted(encodings)[:3]} were encoded: every prompt has a random encoding here")


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
