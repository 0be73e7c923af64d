"""Rollout-only fast weights: the rollout's linears on a merged-LoRA or FP8 copy of their weights.

Legend: M rows of a linear's input (tokens, leading dims flattened), K in features, N out features.

In-process, rollout and trainer share one module, so the copy cannot replace the trained weights: it is built at
the start of a ``generate`` call (so it reflects the weights of the latest sync), kept as plain attributes (not
parameters or buffers: ``state_dict`` and the optimizer never see it), switched on per forward by swapping each
linear's class to a subclass whose forward reads the copy, and freed at the end of the call. The original classes
are restored on every exit, an exception included, so the trainer's replay always runs the LoRA path. Every thread
sees a class swap: each rollout forward holds its denoiser's lock (``forward_lock``), so a generate beside another on
the same module (validation beside the run-ahead rollout) never runs on the other's classes. The trainer's forwards
never overlap a rollout of their module (a step trains on finished trajectories) and take no lock.

FP8 (e4m3, max 448) uses symmetric per-row scales: a weight row (output feature) or an input row (token) is divided
by amax / 448 before the cast, the product multiplied back by both scales. On CUDA sm89+ the product is one
``torch._scaled_mm``; elsewhere it is emulated with the identical quantization (dequantize, fp32 matmul), which is
slower than the plain linear and there only to test the numerics. All quantization is plain torch ops, so a compiled
transformer block fuses it (the class swap makes dynamo compile each mode once).
"""

from __future__ import annotations

import logging
import threading
import weakref
from contextlib import contextmanager
from typing import ContextManager, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from diffrl.configs.rollout import RolloutWeights

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_log = logging.getLogger(__name__)
_warned_emulated = False
_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # denoiser -> its forward lock
_LOCKS_GUARD = threading.Lock()


# ---- FP8 math (pure functions) -------------------------------------------------------------------------------
def row_scales(x_MK: torch.Tensor) -> torch.Tensor:
    """(M, 1) fp32 scales amax / 448 of each row; 1 for an all-zero row (it quantizes to zeros, not NaN)."""
    amax_M1 = x_MK.abs().amax(dim=-1, keepdim=True).float()
    return torch.where(amax_M1 > 0, amax_M1 / FP8_MAX, torch.ones_like(amax_M1))


def quantize_rows(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 (M, K) e4m3, scale (M, 1) fp32) with x ~= x_fp8 * scale; the division is in fp32."""
    scale_M1 = row_scales(x_MK)
    x_fp8_MK = (x_MK.float() / scale_M1).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8_MK, scale_M1


def dequantize_rows(x_fp8_MK: torch.Tensor, scale_M1: torch.Tensor) -> torch.Tensor:
    """(M, K) fp32 values of quantized rows."""
    return x_fp8_MK.float() * scale_M1


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 on this device (CUDA compute capability >= 8.9: Ada, Hopper, ...)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(
    x: torch.Tensor,
    w_fp8_NK: torch.Tensor,
    w_scale_N1: torch.Tensor,
    bias_N: torch.Tensor | None,
    *,
    scaled_mm: bool,
) -> torch.Tensor:
    """x (..., K) @ W.T + bias in FP8: x quantized per token, W (N, K) contiguous, quantized per output row.

    Returns x's dtype. ``scaled_mm`` True: one ``torch._scaled_mm`` (W.T is column-major, as it needs; row-wise
    scales want a bf16 output, cast to x's dtype after); False: the same math emulated in fp32.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x_fp8_MK, x_scale_M1 = quantize_rows(x.reshape(-1, k))
    if scaled_mm:
        out_MN = torch._scaled_mm(
            x_fp8_MK, w_fp8_NK.t(), scale_a=x_scale_M1, scale_b=w_scale_N1.reshape(1, -1), out_dtype=torch.bfloat16
        ).to(x.dtype)
    else:
        out_MN = (dequantize_rows(x_fp8_MK, x_scale_M1) @ dequantize_rows(w_fp8_NK, w_scale_N1).t()).to(x.dtype)
    if bias_N is not None:
        out_MN = out_MN + bias_N.to(x.dtype)
    return out_MN.reshape(*lead, w_fp8_NK.shape[0])


# ---- the forwards the swapped classes run ---------------------------------------------------------------------
class _MergedForward:
    """Mixed into a linear's class: one plain linear on the rollout's merged weight (no LoRA side branch)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return F.linear(x, self._rollout_weight_NK, self._rollout_bias_N)


class _Fp8Forward:
    """Mixed into a linear's class: the FP8 linear on the rollout's quantized weight."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return fp8_linear(
            x, self._rollout_weight_NK, self._rollout_scale_N1, self._rollout_bias_N, scaled_mm=self._rollout_mm
        )


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _fast_class(original: type, forward: type) -> type:
    """`original` with `forward`'s forward: a subclass (peft's isinstance checks hold), one per (type, mode)."""
    key = (original, forward)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"Rollout{forward.__name__[1:]}{original.__name__}", (forward, original), {})
    return _SUBCLASSES[key]


# ---- building the copy ---------------------------------------------------------------------------------------
def _lora_linears(root: nn.Module) -> tuple[list[nn.Module], set[int]]:
    """(peft LoRA Linear wrappers of `root`, ids of their inner modules: base layer and LoRA A/B projections)."""
    from peft.tuners.lora import Linear as LoraLinear

    wrappers = [m for m in root.modules() if isinstance(m, LoraLinear)]
    inner = {id(sub) for m in wrappers for sub in m.modules() if sub is not m}
    return wrappers, inner


def merged_weight(module: nn.Module) -> torch.Tensor | None:
    """(N, K) W + sum of the active adapters' peft deltas, merged in fp32, in the base weight's dtype; None when the
    LoRA branch adds nothing (adapters disabled, or already merged into W)."""
    base = module.get_base_layer()
    if module.disable_adapters or module.merged:
        return None
    active = [name for name in module.active_adapters if name in module.lora_A]
    variants, biases = getattr(module, "lora_variant", {}), getattr(module, "lora_bias", {})
    unsupported = [name for name in active if name in variants or biases.get(name, False)]
    if unsupported:
        raise ValueError(f"rollout.weights supports plain LoRA; adapters {unsupported} use DoRA or a LoRA bias")
    if not active:
        return None
    weight_NK = base.weight.detach().float()
    for name in active:
        weight_NK = weight_NK + module.get_delta_weight(name).detach().float()
    return weight_NK.to(base.weight.dtype)


def _eligible(weight: torch.Tensor) -> bool:
    """FP8 needs 2-D weights with in and out features multiples of 16 (``_scaled_mm``'s alignment)."""
    return weight.ndim == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def _plan(roots: list[nn.Module], kind: str) -> list[tuple[nn.Module, torch.Tensor, torch.Tensor | None]]:
    """(module, weight (N, K) to run, bias) for every linear the kind replaces."""
    plan = []
    for root in roots:
        if any(type(p).__name__ == "DTensor" for p in root.parameters()):
            raise ValueError(
                "rollout.weights.kind merged/fp8 needs an unsharded denoiser (FSDP-sharded here): use lora"
            )
        wrappers, inner = _lora_linears(root)
        for module in wrappers:
            weight = merged_weight(module)
            base = module.get_base_layer()
            if weight is None and kind == "fp8":
                weight = base.weight.detach()
            if weight is not None and (kind == "merged" or _eligible(weight)):
                plan.append((module, weight, base.bias))
        if kind == "fp8":
            for module in root.modules():
                if type(module) is nn.Linear and id(module) not in inner and _eligible(module.weight):
                    plan.append((module, module.weight.detach(), module.bias))
    return plan


def forward_lock(root: nn.Module) -> threading.Lock:
    """The lock a rollout forward on `root` holds (kept beside the module, not in it: a module stays deep-copyable)."""
    with _LOCKS_GUARD:
        if root not in _LOCKS:
            _LOCKS[root] = threading.Lock()
        return _LOCKS[root]


class FastWeights:
    """The rollout-only weight copy of one generate call; ``for_forward`` swaps the linears to it for a forward."""

    def __init__(self, roots: list[nn.Module], weights: RolloutWeights):
        self.weights = weights
        self._lock = forward_lock(roots[0])
        self._swapped: list[tuple[nn.Module, type, type]] = []  # (module, original class, fast class)
        if weights.kind == "lora":
            return
        forward = _Fp8Forward if weights.kind == "fp8" else _MergedForward
        with torch.no_grad():
            for module, weight_NK, bias_N in _plan(roots, weights.kind):
                if weights.kind == "fp8":
                    weight_NK, module._rollout_scale_N1 = quantize_rows(weight_NK)
                    module._rollout_mm = scaled_mm_supported(weight_NK.device)
                    _warn_if_emulated(module._rollout_mm)
                module._rollout_weight_NK = weight_NK.contiguous()
                module._rollout_bias_N = None if bias_N is None else bias_N.detach()
                self._swapped.append((module, type(module), _fast_class(type(module), forward)))

    def for_forward(self, stochastic: bool) -> ContextManager:
        """The context of one transformer forward (holding the lock): on the fast weights, except with kind lora or a
        `stochastic` forward (an in-window sample in the batch) under ``steps: deterministic``."""
        if not self._swapped or (stochastic and self.weights.steps == "deterministic"):
            return self._lock
        return self._active()

    @contextmanager
    def _active(self) -> Iterator[None]:
        with self._lock:
            try:
                for module, _, fast in self._swapped:
                    module.__class__ = fast
                yield
            finally:
                for module, original, _ in self._swapped:
                    module.__class__ = original

    def free(self) -> None:
        """Drop the copies (an fp8 copy of a 20 B-parameter model is ~20 GB)."""
        for module, original, _ in self._swapped:
            module.__class__ = original
            for name in ("_rollout_weight_NK", "_rollout_scale_N1", "_rollout_bias_N", "_rollout_mm"):
                module.__dict__.pop(name, None)
        self._swapped = []


@contextmanager
def rollout_weights(roots: list[nn.Module], weights: RolloutWeights) -> Iterator[FastWeights]:
    """FastWeights of the denoisers `roots` for one generate call, freed (classes restored) on any exit."""
    fast = FastWeights(roots, weights)
    try:
        yield fast
    finally:
        fast.free()


def _warn_if_emulated(scaled_mm: bool) -> None:
    global _warned_emulated
    if not scaled_mm and not _warned_emulated:
        _warned_emulated = True
        _log.warning(
            "rollout.weights.kind fp8: no FP8 matmul on this device (needs CUDA compute capability >= 8.9); "
            "emulating it in fp32, which is slower than the plain linear (for tests, not for speed)"
        )
