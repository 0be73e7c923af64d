"""The trainer's state off the accelerator while a rollout server holds it: a colocated vLLM server gets the GPU's
memory for its KV cache during the rollout, the trainer gets it back for the update.

`HostOffload(module, optimizer)` moves every parameter, buffer and optimizer-state tensor of the trainer to host
memory (`to_host`) and back (`to_device`). Tensors keep their identity: a parameter's `.data` and an optimizer state
entry are swapped for a copy, so the optimizer, the LoRA wrappers and any hook still hold the same objects. The host
copies are pinned (a copy into pinned memory runs at the bus's speed, pageable memory at a fraction of it) and freed
once the tensors are back: a sleeping vLLM server keeps its own weights in host memory while the trainer is on the
device, so the two host copies never coexist. Gradients are expected to be released (`zero_grad(set_to_none=True)`)
before `to_host`; any left are moved as well. On a machine without CUDA the "host" and the device are the same
memory and both moves copy (what the tests exercise: the round trip must leave training unchanged).
"""

from __future__ import annotations

import time

import torch
from torch import nn


class HostOffload:
    """Moves a module's tensors and its optimizer's state between its device and host memory."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.module = module
        self.optimizer = optimizer
        self.on_host = False
        self._devices: dict[object, torch.device] = {}  # each moved tensor's holder -> the device it came from
        self.bytes_moved = 0

    def _holders(self):
        """(key, get, set) for every tensor to move: parameters' data and gradients, buffers, optimizer state."""
        for p in self.module.parameters():
            yield id(p), (lambda p=p: p.data), (lambda t, p=p: setattr(p, "data", t))
            if p.grad is not None:
                yield ("grad", id(p)), (lambda p=p: p.grad), (lambda t, p=p: setattr(p, "grad", t))
        for m in self.module.modules():
            for name, b in m.named_buffers(recurse=False):
                if b is not None:
                    yield (
                        ("buffer", id(m), name),
                        (lambda m=m, n=name: getattr(m, n)),
                        (lambda t, m=m, n=name: setattr(m, n, t)),
                    )
        if self.optimizer is not None:
            for p, state in self.optimizer.state.items():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        yield (
                            ("state", id(p), k),
                            (lambda s=state, k=k: s[k]),
                            (lambda t, s=state, k=k: s.__setitem__(k, t)),
                        )

    def to_host(self) -> float:
        """Everything to host memory (pinned where CUDA is present); returns the seconds it took."""
        if self.on_host:
            return 0.0
        started, moved = time.perf_counter(), 0
        pin = torch.cuda.is_available()
        for key, get, put in self._holders():
            tensor = get()
            if tensor.device.type == "cpu" and pin:
                continue  # already on the host (a CPU-offloaded reference, say): nothing to give back
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            host.copy_(tensor, non_blocking=pin)
            self._devices[key] = tensor.device
            put(host)
            moved += tensor.numel() * tensor.element_size()
        if pin:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self.on_host, self.bytes_moved = True, moved
        return time.perf_counter() - started

    def to_device(self) -> float:
        """Everything back where it was; returns the seconds it took."""
        if not self.on_host:
            return 0.0
        started = time.perf_counter()
        pin = torch.cuda.is_available()
        for key, get, put in self._holders():
            device = self._devices.get(key)
            if device is None:
                continue
            put(get().to(device, non_blocking=pin, copy=True))
        if pin:
            torch.cuda.synchronize()
        self._devices.clear()  # the host copies are garbage now
        self.on_host = False
        return time.perf_counter() - started
