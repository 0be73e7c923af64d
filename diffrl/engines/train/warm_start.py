"""A run that starts from another run's trained weights (`run.init_from`): the weights of one of its checkpoints, and
nothing else of it -- the optimizer, the LR schedule, the counters and the RNG stay those of a new run at step 0.

The checkpoint's files are checked against its checksums.json first; a tensor this trainer trains that the checkpoint
lacks, or holds in another shape (another LoRA rank or targets, another model), is a ValueError naming it, before
any weight changes.
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors.torch import load as st_load
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from diffrl.engines.handle import Engines
from diffrl.engines.store import fs
from diffrl.engines.train.checkpoint import checked_state
from diffrl.engines.train.preference import ema_update
from diffrl.engines.train.setup import trained_module, world


def load_initial_weights(engines: Engines, path: str) -> None:
    """Where the trainer lives (every rank): take the trained weights of checkpoint `path`."""
    load_weights(engines.trainer, path)


def load_weights(trainer: Any, path: str) -> None:
    """The LoRA (or, for full fine-tuning, every weight) of checkpoint `path` into `trainer`'s module."""
    path = path.rstrip("/")
    state = checked_state(path)
    if state["lora"] != trainer.cfg.lora:
        raise ValueError(
            f"run.init_from: checkpoint {path} holds {'a LoRA' if state['lora'] else 'full weights'}, but this run "
            f"trains {'a LoRA' if trainer.cfg.lora else 'full weights'} (train.lora: {trainer.cfg.lora})"
        )
    model = trained_module(trainer.adapter)
    if not trainer.cfg.lora:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        weights = {"model": get_model_state_dict(model)}  # the model's part of the checkpoint only, not its optimizer
        dcp.load(weights, storage_reader=FsspecReader(f"{path}/dcp", **fs.fsspec_options(path)))
        set_model_state_dict(model, weights["model"])
        return
    with fs.open(f"{path}/trainable.safetensors", "rb") as f:
        saved = st_load(f.read())
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    _check_fits(path, saved, trained)
    # rank 0's tensors reach every rank (checkpoint.load explains why FSDP2 needs it)
    options = StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=world()[1] > 1)
    set_model_state_dict(model, {name: saved[name] for name in trained}, options=options)
    if trainer.algorithm.needs.old_adapter:  # the "old" adapter starts as a copy of the policy, as in a new run
        for denoiser in trainer.adapter.denoisers():
            ema_update(denoiser, 0.0)


def _check_fits(path: str, saved: dict[str, torch.Tensor], trained: dict[str, torch.nn.Parameter]) -> None:
    """ValueError naming the first trained tensor the checkpoint lacks or holds in another shape."""
    missing = sorted(set(trained) - set(saved))
    if missing:
        raise ValueError(
            f"run.init_from: checkpoint {path} lacks {len(missing)} of the {len(trained)} tensors this run trains "
            f"(first: {missing[0]}): its model or LoRA targets differ from this config's"
        )
    for name, p in trained.items():
        if tuple(saved[name].shape) != tuple(p.shape):
            raise ValueError(
                f"run.init_from: checkpoint {path} holds {name} in shape {tuple(saved[name].shape)}, this run trains "
                f"it in shape {tuple(p.shape)}: its model or train.lora_rank differ from this config's"
            )
