"""Frozen modules that live in host memory and visit the GPU only while they work (`model.offload_text_encoder`).

A text encoder is never trained and runs only when a prompt is new to the run, so it need not hold GPU memory
between encodings: FLUX.2-dev's Mistral-Small 24B encoder is 48 GB in bf16, more than half an 80 GB card. A
`HostResident` module keeps one copy of its weights in host memory (pinned where the host allows it, so the copy to
the GPU runs at the link's speed) and, inside `on(device)`, points its parameters and buffers at a copy on `device`;
leaving the block points them back at the host copy and the GPU copy is freed. Nothing is copied back: the weights
do not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in host memory, page-locked when CUDA is there to copy from it (pageable if pinning fails)."""
    host = tensor.detach().to("cpu")
    if torch.cuda.is_available():
        try:
            return host.pin_memory()
        except RuntimeError:  # a host that refuses page-locked memory: pageable copies are slower, still correct
            return host
    return host


class HostResident:
    """A frozen module whose weights stay in host memory; `on(device)` lends them to `device` for one block."""

    def __init__(self, name: str, module: nn.Module):
        self.name = name
        self.module = module
        self.trips = 0  # blocks run on a device: each is one copy of the weights over the link
        self.bytes = 0
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter or buffer, its host copy)
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.requires_grad:
                raise ValueError(f"{name} has trainable weights: only frozen modules can wait in host memory")
            host = _pinned(tensor)
            tensor.data = host
            self._host.append((tensor, host))
            self.bytes += host.numel() * host.element_size()

    @contextlib.contextmanager
    def on(self, device: torch.device) -> Iterator[nn.Module]:
        """The module with its weights on `device` inside the block, back on the host copy after it."""
        device = torch.device(device)
        self.trips += 1
        for tensor, host in self._host:
            tensor.data = host.to(device, non_blocking=True, copy=True)
        try:
            yield self.module
        finally:
            for tensor, host in self._host:
                tensor.data = host


@contextlib.contextmanager
def all_on(modules: list[HostResident], device: torch.device) -> Iterator[None]:
    """Every module of `modules` on `device` inside the block."""
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(module.on(device))
        yield
