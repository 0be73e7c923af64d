"""Pieces of the update on final samples (Needs.data "final_samples": Diffusion-DPO, DiffusionNFT, AWM).

Legend: B samples of one RL step, b samples of a micro-batch, P preference pairs, S latent shape.
The clean sample x0 is the latent after the last denoising step, so the rollout's window must end at the last step
(algorithms.windows.ends_at_last_step). Each sample gets its own noise and noise level, drawn from a generator keyed
by (seed, update, epoch, sample seed): x_t = (1 - sigma) x0 + sigma noise, flow-matching target = noise - x0.
An algorithm whose needs.old_adapter keeps a second LoRA adapter "old", an EMA of "default" with decay
`algorithm.old_adapter_decay(update)` applied after every update (DiffusionNFT's old policy). Its rollout samples with
that adapter: the trainer's own (`PolicyTrainer.old_policy`), or in an asynchronous run the behaviour copy's
(:func:`sampling_with_old_adapter`), which holds the "old" tensors of its version.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable

import torch

from diffrl.configs.train import TrainConfig
from diffrl.engines.train.setup import ADAPTER_NAME, add_lora
from diffrl.engines.trajectories import Trajectories
from diffrl.models.base import ModelAdapter

OLD_ADAPTER = "old"


def lora_pairs(transformer) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """(default, old) LoRA parameter pairs of the same module."""
    params = dict(transformer.named_parameters())
    return [
        (p, params[n.replace(f".{ADAPTER_NAME}.", f".{OLD_ADAPTER}.")])
        for n, p in params.items()
        if f".{ADAPTER_NAME}." in n and "lora_" in n
    ]


@torch.no_grad()
def ema_update(transformer, decay: float) -> None:
    """old <- decay * old + (1 - decay) * default (decay 0 copies)."""
    for new, old in lora_pairs(transformer):
        old.mul_(decay).add_(new.detach(), alpha=1.0 - decay)


def activate(transformer, name: str) -> None:
    """Make adapter `name` the one the forward uses; only "default" is ever trainable."""
    transformer.set_adapter(name)
    for pname, p in transformer.named_parameters():  # set_adapter also flips requires_grad: undo that
        p.requires_grad_(f".{ADAPTER_NAME}." in pname and "lora_" in pname)


@contextlib.contextmanager
def sampling_with_old_adapter(adapter: ModelAdapter):
    """Within it, `adapter` (an asynchronous run's behaviour copy: every tensor frozen, diffrl/engines/train/sync.py)
    samples with its "old" LoRA adapter, without autograd. Only its own LoRA tensors' flags are touched: set_adapter
    marks the active adapter trainable, and the copy's LoRA tensors stay frozen."""

    def use(name: str) -> None:
        for transformer in adapter.denoisers():
            transformer.set_adapter(name)
            for pname, p in transformer.named_parameters():
                if "lora_" in pname:
                    p.requires_grad_(False)

    with torch.no_grad():
        use(OLD_ADAPTER)
        try:
            yield
        finally:
            use(ADAPTER_NAME)


def add_old_adapter(adapter: ModelAdapter, cfg: TrainConfig, algorithm_name: str) -> None:
    """The "old" LoRA adapter, a copy of "default" (after LoRA injection, before sharding and the optimizer)."""
    if not cfg.lora:
        raise ValueError(
            f"{algorithm_name} needs lora: true (its old policy, or its moving reference, is a second LoRA adapter "
            "named 'old'); docs/algorithms.md says which of its settings run without one"
        )
    for transformer in adapter.denoisers():  # each Wan2.2 expert keeps its own old adapter
        add_lora(transformer, cfg, cfg.lora_targets or tuple(adapter.default_lora_targets), name=OLD_ADAPTER)
        activate(transformer, ADAPTER_NAME)
        ema_update(transformer, 0.0)


def preference_pairs(advantages: torch.Tensor, group_ids: list[str]) -> list[tuple[int, int]]:
    """(chosen, rejected) per group: the highest- and lowest-advantage samples; groups without a gap are skipped."""
    pairs = []
    for rows in whole_groups(group_ids):
        best = max(rows, key=lambda i: float(advantages[i]))
        worst = min(rows, key=lambda i: float(advantages[i]))
        if float(advantages[best]) > float(advantages[worst]):
            pairs.append((best, worst))
    return pairs


def whole_groups(group_ids: list[str]) -> list[list[int]]:
    """The rows of each group, groups in the order they first appear."""
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    return list(members.values())


def training_units(
    advantages: torch.Tensor, group_ids: list[str], pairs: bool, groups: bool = False
) -> list[list[int]]:
    """What one loss term trains on: (chosen, rejected) pairs when the algorithm needs pairs, whole groups when it
    needs groups, else each sample."""
    if pairs:
        return [list(p) for p in preference_pairs(advantages, group_ids)]
    if groups:
        return whole_groups(group_ids)
    return [[i] for i in range(len(group_ids))]


def check_final_latents(traj: Trajectories, num_steps: int, algorithm_name: str) -> None:
    """ValueError unless every sample's window ends at the last denoising step (its last latent is x0)."""
    if not bool((traj.step_indices[:, -1] == num_steps - 1).all()):
        raise ValueError(
            f"algorithm {algorithm_name!r} trains on final samples: the rollout window must end at the last step "
            f"({num_steps - 1}); e.g. WindowPolicy('final', size=1) or WindowPolicy('random_start', size=1, "
            f"start_range=({num_steps - 1}, {num_steps}))"
        )


def training_sigmas(sigmas_N: torch.Tensor, highest: int) -> torch.Tensor:
    """The schedule `noised_samples` draws from: all of it, or (0 < highest < N) its first `highest` sigmas, the
    highest noise levels, then its final 0 (which is never drawn)."""
    if 0 < highest < len(sigmas_N) - 1:
        return torch.cat([sigmas_N[:highest], sigmas_N[-1:]])
    return sigmas_N


def noised_samples(
    x0: torch.Tensor,
    seeds: torch.Tensor,
    sigmas_N: torch.Tensor,
    key: int,
    draw_sigma: Callable[[torch.Generator], torch.Tensor] | None = None,
):
    """Per sample (sigma (b,), x_t, target) on the CPU, drawn from a generator keyed by `key` + the sample's seed:
    sigma uniform over the schedule's non-zero sigmas (or `draw_sigma(generator)`, the algorithm's own density),
    x_t = (1 - sigma) x0 + sigma noise, target = noise - x0."""
    sig, x_t, target = [], [], []
    for i, seed in enumerate(seeds.tolist()):
        gen = torch.Generator().manual_seed((key + int(seed)) % 2**63)
        if draw_sigma is not None:
            s = draw_sigma(gen).float().reshape(())
        else:
            s = sigmas_N[torch.randint(0, len(sigmas_N) - 1, (1,), generator=gen)].reshape(())
        noise = torch.randn(x0.shape[1:], generator=gen)
        sig.append(s)
        x_t.append((1 - s) * x0[i] + s * noise)
        target.append(noise - x0[i])
    return torch.stack(sig), torch.stack(x_t), torch.stack(target)
