"""Building the trainable model: LoRA (peft) or full fine-tuning, dtypes, FSDP2, optimizer, LR schedule.

Every function here acts on the adapter's denoiser in place, so `adapter.velocity` (and therefore
the rollout engine sharing the adapter) runs the trained weights without any copy.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from diffrl.configs.train import TrainConfig
from diffrl.models.base import ModelAdapter

ADAPTER_NAME = "default"


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when torch.distributed is not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    """torch.distributed barrier across the trainer ranks (nothing with one process)."""
    if world()[1] > 1:
        dist.barrier()


def lora_config(cfg: TrainConfig, targets: tuple[str, ...]):
    """The peft LoraConfig of the trained adapter (also written into the checkpoint's metadata)."""
    from peft import LoraConfig

    init = True if cfg.lora_init == "default" else cfg.lora_init
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, init_lora_weights=init, target_modules=list(targets))


def check_targets(transformer: nn.Module, targets: tuple[str, ...]) -> None:
    """ValueError naming the targets that match no module of the transformer (peft would only say 'not found')."""
    names = [name for name, _ in transformer.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ValueError(
            f"lora_targets {missing} match no module of {type(transformer).__name__}; "
            f"examples of module names: {[n for n in names if n][:12]}"
        )


def add_lora(transformer: nn.Module, cfg: TrainConfig, targets: tuple[str, ...], name: str = ADAPTER_NAME) -> None:
    """Inject a LoRA adapter `name` in place (diffusers' PeftAdapterMixin.add_adapter) and freeze the rest.

    LoRA weights are kept in fp32 even over a bf16 base: they are the optimizer's master weights
    (peft casts the input to the LoRA weight dtype and the result back).
    """
    check_targets(transformer, targets)
    if not hasattr(transformer, "add_adapter"):
        raise TypeError(
            f"{type(transformer).__name__} has no add_adapter (diffusers PeftAdapterMixin); cannot add LoRA"
        )
    seed_state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)  # LoRA init draws from the global RNG: make it a function of cfg.seed
    transformer.add_adapter(lora_config(cfg, targets), adapter_name=name)
    torch.random.set_rng_state(seed_state)
    for pname, param in transformer.named_parameters():
        is_lora = f".{name}." in pname and "lora_" in pname
        param.requires_grad_(is_lora)
        if is_lora:
            param.data = param.data.float()
    apply_lora_compute(transformer, cfg.lora_compute)


class CastLinear(nn.Linear):
    """A LoRA A or B projection that multiplies in `compute_dtype` while its weight stays fp32 (the
    optimizer's master copy). The cast is in the autograd graph, so the gradient reaches the fp32 weight."""

    compute_dtype: torch.dtype = torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return F.linear(x.to(self.compute_dtype), self.weight.to(self.compute_dtype), bias)


def apply_lora_compute(transformer: nn.Module, lora_compute: str) -> None:
    """`train.lora_compute`: "base" multiplies every LoRA branch in its base layer's dtype, "fp32" in fp32."""
    from peft.tuners.lora import LoraLayer

    base = next(m.get_base_layer().weight.dtype for m in transformer.modules() if isinstance(m, LoraLayer))
    # over an fp32 base, "base" is fp32 too: peft's own fp32 path
    set_lora_compute_dtype(transformer, base if lora_compute == "base" and base != torch.float32 else None)


def set_lora_compute_dtype(transformer: nn.Module, dtype: torch.dtype | None) -> int:
    """Make every LoRA branch multiply in `dtype` (`lora_compute: base`), or in its weights' fp32 again (None).

    peft casts a LoRA layer's input to the LoRA weights' dtype, so fp32 LoRA over a bf16 base runs its
    matmuls in fp32 (on a GPU: plain fp32 or TF32 units). Here the cast is switched off and the A/B
    projections compute in `dtype`; parameter names, dtypes and checkpoints are unchanged. Returns the
    number of LoRA layers changed.
    """
    from peft.tuners.lora import LoraLayer

    changed = 0
    for module in transformer.modules():
        if not isinstance(module, LoraLayer):
            continue
        module.cast_input_dtype_enabled = dtype is None
        for linear in [*module.lora_A.values(), *module.lora_B.values()]:
            if dtype is None:
                if type(linear) is CastLinear:
                    linear.__class__ = nn.Linear
                continue
            if type(linear) not in (nn.Linear, CastLinear):
                raise TypeError(f"lora_compute: base supports Linear LoRA projections, not {type(linear).__name__}")
            linear.__class__ = CastLinear
            linear.compute_dtype = dtype
        changed += 1
    return changed


def denoiser_names(adapter: ModelAdapter) -> list[str]:
    """The pipeline component name of each denoiser ("transformer", and Wan2.2's low-noise "transformer_2")."""
    denoisers = adapter.denoisers()
    if len(denoisers) == 1:
        return ["transformer"]
    names = {id(module): name for name, module in adapter.pipe.components.items() if module is not None}
    return [names[id(module)] for module in denoisers]


def trained_module(adapter: ModelAdapter) -> nn.Module:
    """The module whose parameters the trainer updates, checkpoints and syncs: the denoiser itself, or with several
    (Wan2.2's two experts) a ModuleDict of them by component name, so a parameter's name says which expert holds it
    ("transformer.blocks.0...", "transformer_2.blocks.0..."). The ModuleDict is a fresh view each call (it is never
    sharded or called itself; each expert is its own FSDP root), so an adapter's copy gets its own experts."""
    denoisers = adapter.denoisers()
    if len(denoisers) == 1:
        return adapter.transformer
    return nn.ModuleDict(dict(zip(denoiser_names(adapter), denoisers)))


def prepare_denoiser(adapter: ModelAdapter, cfg: TrainConfig, device: torch.device) -> list[nn.Parameter]:
    """Move/cast every denoiser, add LoRA or unfreeze everything, enable checkpointing; returns trainable params.

    Several denoisers (Wan2.2's experts) each get the same LoRA (targets, rank, seed); a step's gradient reaches only
    the expert the adapter's velocity routed it to."""
    dtype = cfg.torch_param_dtype(device, adapter.dtype)
    # Full fine-tuning keeps fp32 master weights; bf16 compute then comes from FSDP's MixedPrecisionPolicy.
    if not cfg.lora and dtype != torch.float32 and world()[1] == 1:
        raise ValueError(
            f"param_dtype {cfg.param_dtype!r} resolves to {dtype} for full fine-tuning (lora: false), "
            "which needs FSDP (world size > 1) for its bf16 compute; use param_dtype: fp32 or lora: true"
        )
    target = dtype if cfg.lora else torch.float32
    adapter.dtype = dtype
    for transformer in adapter.denoisers():
        if next(transformer.parameters()).dtype != target:  # diffusers warns on any .to(dtype), even a no-op
            transformer.to(dtype=target)
        transformer.to(device=device)
        if cfg.lora:
            add_lora(transformer, cfg, cfg.lora_targets or tuple(adapter.default_lora_targets))
        else:
            transformer.requires_grad_(True)
        if cfg.gradient_checkpointing:
            if not hasattr(transformer, "enable_gradient_checkpointing"):
                raise ValueError(f"gradient_checkpointing: {type(transformer).__name__} does not support it")
            transformer.enable_gradient_checkpointing()
        transformer.train()
    return [p for p in trained_module(adapter).parameters() if p.requires_grad]


def shard(
    adapter: ModelAdapter,
    cfg: TrainConfig,
    device: torch.device,
    module: nn.Module | None = None,
    *,
    replicate: bool = False,
) -> None:
    """FSDP2: `fully_shard` each of the adapter's wrap units, then the root denoiser (world size > 1).

    replicate=True: HSDP over a (world, 1) mesh, every rank keeping whole parameters and the gradients all-reduced
    (data parallelism of engine replicas training LoRA: each replica samples with the same module between updates,
    with no collective, and the frozen base is never gathered)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    _, size = world()
    mesh = (
        init_device_mesh(device.type, (size, 1), mesh_dim_names=("replicate", "shard"))
        if replicate
        else init_device_mesh(device.type, (size,))
    )
    # Gradients are reduced in fp32 whatever the compute dtype. Full fine-tuning all-gathers its fp32 master
    # weights in the compute dtype. LoRA keeps every parameter's own dtype (frozen base in the compute dtype,
    # LoRA in fp32, as add_lora leaves them), so a LoRA branch computes in fp32 on any world size: casting it
    # to bf16 made 2 processes drift from 1 by 34x the bf16 summation-order noise (fsdp_equivalence.py).
    compute = None if cfg.lora else cfg.torch_param_dtype(device, adapter.dtype)
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if cfg.offload_optimizer else OffloadPolicy()
    # Each denoiser is its own root (Wan2.2's experts run in separate forwards): its wrap units, then itself.
    roots = [module] if module is not None else adapter.denoisers()
    units = adapter.fsdp_wrap_units() if module is None else _same_units(adapter, module)
    for root in roots:
        inside = {id(m) for m in root.modules()}
        for unit in units:
            if id(unit) in inside:
                fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(root, mesh=mesh, mp_policy=mp, offload_policy=offload)


def _same_units(adapter: ModelAdapter, copy: nn.Module) -> list[nn.Module]:
    """The wrap units of a deep copy of the transformer (same module paths)."""
    paths = {id(m): n for n, m in adapter.transformer.named_modules()}
    by_name = dict(copy.named_modules())
    return [by_name[paths[id(u)]] for u in adapter.fsdp_wrap_units()]


def build_optimizer(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (foreach off on CPU offload: the step runs on CPU tensors)."""
    if not params:
        raise ValueError("no trainable parameters: check lora_targets / lora")
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=cfg.eps)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr after `step` optimizer steps: linear warm-up, then constant or cosine to 0."""
    if cfg.lr_schedule == "constant":
        return 1.0
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "warmup_constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over :func:`lr_factor` (its state_dict is plain numbers, checkpointed as JSON)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def apply_optimizer_config(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: TrainConfig
) -> None:
    """Set the optimizer's hyper-parameters from `cfg` once a checkpoint's state is loaded. The state dicts bring
    back the values they were saved with (each group's lr, betas, weight decay and eps, and the scheduler's base
    lrs), so a run resumed with another train.lr would train on with the old one. The learning rate becomes the
    schedule's at the restored step, computed as LambdaLR computes it: with an unchanged config, the same numbers."""
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    lrs = [base * factor(scheduler.last_epoch) for factor, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group.update(lr=lr, initial_lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=cfg.eps)
    scheduler._last_lr = lrs  # what get_last_lr (actor/lr) reports until the next optimizer step


def check_offload(cfg: TrainConfig) -> None:
    """offload_optimizer works through FSDP2's CPUOffloadPolicy, i.e. only when sharding."""
    if cfg.offload_optimizer and world()[1] == 1:
        raise ValueError(
            "offload_optimizer needs torch.distributed with world size > 1 (FSDP2 CPUOffloadPolicy); "
            "set offload_optimizer: false for a single-process run"
        )
