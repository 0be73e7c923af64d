"""Trainer checkpoints on any fsspec path: safetensors / JSON / torch.distributed.checkpoint, no pickle.

Layout of one checkpoint folder:
    lora/pytorch_lora_weights.safetensors   LoRA only: diffusers format (`pipe.load_lora_weights(folder/lora)`); a
                                            causal LM's: lora/adapter_model.safetensors + adapter_config.json (PEFT)
    lora/pytorch_lora_weights_transformer_2.safetensors
                                            Wan2.2's low-noise expert (the file above is the high-noise one):
                                            `pipe.load_lora_weights(folder/lora, weight_name=...,
                                            load_into_transformer_2=True)`, diffusers' way to load an expert's LoRA
    trainable.safetensors                   LoRA only: the trainable tensors under the module's own names
    optimizer.safetensors, optimizer.json   LoRA only: AdamW state tensors / param-group hyper-parameters
    dcp/                                    full fine-tuning: model + optimizer, sharded (torch DCP)
    trainer_state.json                      step, counters, policy version, LR schedule, python RNG
    rng_rank<r>.safetensors                 torch CPU (and CUDA) RNG state of every rank
    checksums.json                          size and sha256 of every file above, written last, checked by `load`
LoRA state is gathered to full tensors (it is small); full weights stay sharded through DCP.

A file that differs from its checksum (flipped bytes, a truncated copy) or is missing, checksums.json included, makes
`load` raise CorruptCheckpoint naming it, before any state changes: a run then resumes from an earlier checkpoint
(diffrl/flows/train.py) instead of training on damaged weights. DIFFRL_INJECT_FAULT="checkpoint@<step>.<i>[:exit]"
fails (or kills the process) just before a LoRA checkpoint writes its i-th file (diffrl/engines/step/plan.py).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import tempfile
import warnings
import weakref
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from diffrl.engines.numbering import step_index, step_number
from diffrl.engines.step.plan import inject_fault
from diffrl.engines.store import fs
from diffrl.engines.train.setup import (
    ADAPTER_NAME,
    apply_optimizer_config,
    barrier,
    denoiser_names,
    lora_config,
    trained_module,
    world,
)
from diffrl.engines.train.tensor_file import write_tensors

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
CHECKSUMS = "checksums.json"
LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' default weight_name: the (high-noise) `transformer`'s
DCP_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


def _quiet_single_process_dcp() -> None:
    """DCP warns at every save and load without a process group ("assuming the intent is to save in a single
    process"): a one-process full fine-tuning run is that intent, and it saves at every step (omni_quick printed the
    warning 100 times). A process-wide filter, not warnings.catch_warnings (not thread-safe; saves run off-thread),
    added only where missing: a catch_warnings block around an import drops a filter set then, and every change to the
    filters shows each 'once' warning again."""
    if not any(f[0] == "ignore" and f[1] is not None and f[1].pattern == DCP_SINGLE_PROCESS for f in warnings.filters):
        warnings.filterwarnings("ignore", message=DCP_SINGLE_PROCESS)


def lora_file_name(component: str) -> str:
    """The LoRA file of the denoiser `component`: diffusers' default name for "transformer", else
    pytorch_lora_weights_<component>.safetensors (Wan2.2's "transformer_2", loaded with load_into_transformer_2)."""
    return LORA_FILE if component == "transformer" else f"pytorch_lora_weights_{component}.safetensors"


class CorruptCheckpoint(ValueError):
    """A checkpoint file that is missing, unreadable, or not the bytes that were written (names the file)."""


def _write(path: str, data: bytes) -> None:
    with fs.open(path, "wb") as f:
        f.write(data)


def _write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> dict:
    """A safetensors file written piece by piece (diffrl/engines/train/tensor_file.py: the GIL stays free for the
    threads beside a background write); its {"bytes", "sha256"}."""
    with fs.open(path, "wb") as f:
        return write_tensors(f, tensors)


def _read(path: str) -> bytes:
    with fs.open(path, "rb") as f:
        return f.read()


def _digest(data: bytes) -> dict:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _file_digest(path: str) -> dict:
    """_digest of a file read in 16 MiB pieces (DCP shards can be large)."""
    with fs.open(path, "rb") as f:
        return _stream(f)


def _stream(src, dst=None) -> dict:
    """_digest of what `src` holds, read in 16 MiB pieces and written to `dst` on the way when given."""
    sha, size = hashlib.sha256(), 0
    while piece := src.read(1 << 24):
        if dst is not None:
            dst.write(piece)
        sha.update(piece)
        size += len(piece)
    return {"bytes": size, "sha256": sha.hexdigest()}


class _Files:
    """Writes a checkpoint's files, remembering their checksums; `close` writes checksums.json last, so a folder
    whose write was cut short has no (or an older) list and fails `verify`."""

    def __init__(self, path: str, step: int):
        self.path, self.step, self.sums = path, step, {}

    def put(self, name: str, data: bytes) -> None:
        self._fault()
        _write(f"{self.path}/{name}", data)
        self.sums[name] = _digest(data)

    def put_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self._fault()
        self.sums[name] = _write_tensors(f"{self.path}/{name}", tensors)

    def put_file(self, name: str, local: str) -> None:
        """Copy the local file `local` in 16 MiB pieces (a LoRA file diffusers wrote)."""
        self._fault()
        with open(local, "rb") as src, fs.open(f"{self.path}/{name}", "wb") as dst:
            self.sums[name] = _stream(src, dst)

    def _fault(self) -> None:
        # fault point before each file; self.step is the step number trainer_state.json records
        inject_fault("checkpoint", step_index(self.step), len(self.sums))

    def close(self) -> None:
        _write(f"{self.path}/{CHECKSUMS}", json.dumps(self.sums, indent=1, sort_keys=True).encode())


def write_checksums(path: str) -> None:
    """checksums.json of every file under the checkpoint folder `path` (read back: DCP writes its own files)."""
    files, root = fs.filesystem(path.rstrip("/"))
    names = sorted(os.path.relpath(f, root) for f in files.find(root))
    sums = {name: _file_digest(f"{path.rstrip('/')}/{name}") for name in names if name != CHECKSUMS}
    _write(f"{path.rstrip('/')}/{CHECKSUMS}", json.dumps(sums, indent=1, sort_keys=True).encode())


def verify(path: str) -> None:
    """CorruptCheckpoint naming the first file of checkpoint `path` that is missing or differs from checksums.json.
    A checkpoint without the list is unfinished or damaged (every checkpoint of this run format has one, written
    last): it is never loaded unverified."""
    path = path.rstrip("/")
    listing = f"{path}/{CHECKSUMS}"
    if not fs.exists(listing):
        raise CorruptCheckpoint(
            f"checkpoint file {listing} is missing: its files cannot be checked (a write cut short, or removed)"
        )
    try:
        sums = json.loads(_read(listing))
    except ValueError as e:
        raise CorruptCheckpoint(f"checkpoint file {listing} is not readable JSON ({e})") from None
    for name, want in sorted(sums.items()):
        file = f"{path}/{name}"
        if not fs.exists(file):
            raise CorruptCheckpoint(f"checkpoint file {file} is missing")
        got = _file_digest(file)
        if got["bytes"] != want["bytes"]:
            raise CorruptCheckpoint(
                f"checkpoint file {file} has {got['bytes']} bytes where {want['bytes']} were written (truncated?)"
            )
        if got["sha256"] != want["sha256"]:
            raise CorruptCheckpoint(
                f"checkpoint file {file} does not match its checksum (sha256 {got['sha256'][:16]}, written "
                f"{want['sha256'][:16]}): its bytes changed after it was written"
            )


def _load_tensors(path: str) -> dict[str, torch.Tensor]:
    try:
        return st_load(_read(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
        raise CorruptCheckpoint(f"checkpoint file {path} is not a readable safetensors file ({e})") from None


def _load_json(path: str):
    try:
        return json.loads(_read(path))
    except ValueError as e:
        raise CorruptCheckpoint(f"checkpoint file {path} is not readable JSON ({e})") from None


class NonFiniteWeights(RuntimeError):
    """The policy's trainable weights hold inf or NaN: training on (or checkpointing) them would waste the run."""


def check_finite_weights(trainer, step: int) -> None:
    """NonFiniteWeights naming the trainable parameters (this rank's shards) that are not finite after the update of
    step index `step` (named by its step number). A non-finite gradient norm already skips its optimizer step; this
    catches what gets past it (a learning rate or loss scale that overflows the weights themselves)."""
    named = [(n, p) for n, p in trained_module(trainer.adapter).named_parameters() if p.requires_grad]
    if not named:
        return
    local = [p.to_local() if hasattr(p, "to_local") else p for _, p in named]
    finite = torch.stack([torch.isfinite(p.detach()).all() for p in local]).cpu()
    if bool(finite.all()):
        return
    bad = [name for (name, _), ok in zip(named, finite.tolist()) if not ok]
    raise NonFiniteWeights(
        f"step {step_number(step)}: after the update {len(bad)} of the policy's {len(named)} trainable tensors hold "
        f"inf or NaN (first: {bad[0]}); the run stops before this step's checkpoint, so the last checkpoint holds "
        f"finite weights. Lower train.lr before running it again (actor/grad_norm, actor/pg_loss and actor/lr in "
        f"MLflow show where it diverged)"
    )


def trainable_state(trainer, *, all_lora: bool = False) -> dict[str, torch.Tensor]:
    """Full (gathered, CPU) tensors of every trainable parameter, keyed by module parameter name.

    all_lora also includes frozen LoRA adapters (DiffusionNFT's "old" policy) for checkpoints. With several denoisers
    the names start with the expert's component name (setup.trained_module).
    """
    model = trained_module(trainer.adapter)
    params = dict(model.named_parameters())
    trained = {name for name, p in params.items() if p.requires_grad or (all_lora and "lora_" in name)}
    flipped = [params[n] for n in trained if not params[n].requires_grad]
    for p in flipped:  # ignore_frozen_params keeps the (huge) frozen base out of the gather; keep these in
        p.requires_grad_(True)
    try:
        state = get_model_state_dict(model, options=_FULL)
    finally:
        for p in flipped:
            p.requires_grad_(False)
    # get_model_state_dict also returns buffers (e.g. SD3's pos_embed table): not trained, not saved.
    return {k: v.contiguous() for k, v in state.items() if k in trained}


def lora_state(trainer, trainable: dict[str, torch.Tensor] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Per denoiser component ("transformer", Wan2.2's "transformer_2"): its LoRA tensors in peft's saved naming
    (adapter name and expert prefix removed), as diffusers expects one denoiser's LoRA."""
    from peft.utils import get_peft_model_state_dict

    trainable = trainable if trainable is not None else trainable_state(trainer)
    denoisers = trainer.adapter.denoisers()
    if len(denoisers) == 1:
        return {
            "transformer": get_peft_model_state_dict(
                trainer.adapter.transformer, state_dict=trainable, adapter_name=ADAPTER_NAME
            )
        }
    states = {}
    for component, module in zip(denoiser_names(trainer.adapter), denoisers):
        prefix = component + "."
        own = {k[len(prefix) :]: v for k, v in trainable.items() if k.startswith(prefix)}
        states[component] = get_peft_model_state_dict(module, state_dict=own, adapter_name=ADAPTER_NAME)
    return states


def save_diffusers_lora(pipe_cls: type, folder: str, layers: dict[str, dict[str, torch.Tensor]], metadata: dict):
    """Write each denoiser's LoRA into the local `folder` through the pipeline's own save_lora_weights, one file per
    denoiser (lora_file_name), as diffusers loads Wan2.2's experts."""
    for component, tensors in layers.items():
        pipe_cls.save_lora_weights(
            folder,
            transformer_lora_layers=tensors,
            transformer_lora_adapter_metadata=metadata,
            weight_name=lora_file_name(component),
        )


def export_lora(trainer, path: str, trainable: dict[str, torch.Tensor] | None = None) -> str:
    """Write the LoRA as `path`/pytorch_lora_weights.safetensors through the pipeline's own save_lora_weights.

    The LoraConfig (rank, alpha, targets) goes into the file's metadata, so `load_lora_weights`
    restores the same scaling. All ranks must call it (the state is gathered); rank 0 writes.
    """
    if not trainer.cfg.lora:
        raise ValueError(
            "export_lora: this trainer does full fine-tuning (TrainConfig.lora is false); there is no LoRA to export"
        )
    layers = lora_state(trainer, trainable)
    if world()[0] == 0:
        pipe_cls = type(trainer.adapter.pipe)
        if not hasattr(pipe_cls, "save_lora_weights"):
            raise TypeError(f"{pipe_cls.__name__} has no save_lora_weights: diffusers cannot load LoRAs for it")
        targets = trainer.cfg.lora_targets or tuple(trainer.adapter.default_lora_targets)
        metadata = lora_config(trainer.cfg, targets).to_dict()
        with tempfile.TemporaryDirectory() as tmp:
            save_diffusers_lora(pipe_cls, tmp, layers, metadata)
            for name in sorted(os.listdir(tmp)):
                _write(f"{path.rstrip('/')}/{name}", open(os.path.join(tmp, name), "rb").read())
    barrier()
    return path


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _trainer_state(trainer, step: int) -> dict:
    sched = {k: v for k, v in trainer.scheduler.state_dict().items() if k != "lr_lambdas"}
    return {
        "step": step,
        "optimizer_steps": trainer.optimizer_steps,
        "updates": trainer.updates,
        "policy_version": trainer.policy_version,
        "scheduler": sched,
        "python_random": random.getstate(),
        "lora": trainer.cfg.lora,
        "world_size": trainer.world_size,
        "stepped_since_sync": trainer.stepped_since_sync,
    }


def _split_optimizer(osd: dict) -> tuple[dict[str, torch.Tensor], list]:
    """A full optimizer state dict {state: {fqn: {key: tensor}}, param_groups: [...]} -> (tensors, groups).

    Tensors are keyed "fqn/key" for safetensors; param groups (hyper-parameters, fqn lists) go to JSON.
    (torch's flatten_optimizer_state_dict cannot be loaded back with full_state_dict in torch 2.13.)
    """
    tensors = {
        f"{fqn}/{key}": torch.as_tensor(v).contiguous()
        for fqn, per_param in osd["state"].items()
        for key, v in per_param.items()
    }
    return tensors, osd["param_groups"]


def _join_optimizer(tensors: dict[str, torch.Tensor], groups: list) -> dict:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        fqn, key = name.rsplit("/", 1)
        state.setdefault(fqn, {})[key] = value
    # JSON turned tuples (AdamW betas) into lists.
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in groups]
    return {"state": state, "param_groups": groups}


@dataclass
class LoraSnapshot:
    """A LoRA trainer's whole checkpoint state as CPU copies, taken between updates, written later: the step core
    takes it right after the update (asynchronous copies: nothing on the step's path waits for the GPU) and writes it
    on its background writer while the next rollout runs (`snapshot`, then `write`, which waits for the copies)."""

    step: int
    trainable: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    optimizer_groups: list
    lora_keys: dict[str, dict[str, str]]  # per denoiser component: peft's saved name -> trainable name
    lora_metadata: dict
    pipe_cls: type | None  # None: a causal LM's LoRA, written as a PEFT adapter folder
    trainer_state: dict
    rng: dict[str, torch.Tensor]
    copied: torch.cuda.Event | None = None  # the device-to-host copies have landed once this event has


def snapshot(trainer, *, step: int) -> LoraSnapshot:
    """Copy a single-process LoRA trainer's checkpoint state to the CPU, asynchronously from a GPU (the next update
    may start right after; `write` waits for the copies)."""
    if not trainer.cfg.lora or trainer.world_size != 1:
        raise ValueError(
            "checkpoint.snapshot: only a single-process LoRA trainer is snapshotted; "
            "use save() for full fine-tuning or several ranks"
        )
    # One process, unsharded: the parameters and the optimizer state are read directly (copies: the next update
    # changes them), not through torch.distributed's state-dict helpers, which walk every module and cost ~80 ms even
    # for the CPU quickstart's 126 LoRA tensors; the names are the ones those helpers give, found once per trainer.
    # Asynchronous copies into pinned host memory: a blocking copy waits for the GPU's queue, 40 ms a step on the
    # shapes recipe's path (H200), where the next rollout waited for it.
    plan = _snapshot_plan(trainer)
    trainable = {name: _copy_out(p) for name, p in plan.params}
    optimizer = {}
    for fqn, p in plan.params:
        for key, value in trainer.optimizer.state.get(p, {}).items():
            optimizer[f"{fqn}/{key}"] = _copy_out(torch.as_tensor(value))
    copied = None
    if any(p.is_cuda for _, p in plan.params):
        copied = torch.cuda.Event()
        copied.record()
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": fqns}
        for group, fqns in zip(trainer.optimizer.param_groups, plan.group_fqns)
    ]
    # the counters, schedule and RNG now: the weight sync and the next rollout move them
    trainer_state = copy.deepcopy(_trainer_state(trainer, step))
    rng = {k: v.clone() for k, v in _rng_state().items()}
    return LoraSnapshot(
        step=step,
        trainable=trainable,
        optimizer=optimizer,
        optimizer_groups=copy.deepcopy(groups),
        lora_keys=plan.lora_keys,
        lora_metadata=plan.lora_metadata,
        pipe_cls=plan.pipe_cls,
        trainer_state=trainer_state,
        rng=rng,
        copied=copied,
    )


def _copy_out(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `tensor`; from a GPU, into pinned memory without waiting (valid once the snapshot's event has
    passed)."""
    return tensor.detach().to("cpu", non_blocking=tensor.is_cuda, copy=True)


@dataclass(frozen=True)
class _SnapshotPlan:
    params: list[tuple[str, torch.nn.Parameter]]  # (name, parameter) of every trained or LoRA parameter
    group_fqns: list[list[str]]  # the optimizer's parameter groups by name
    lora_keys: dict[str, str]
    lora_metadata: dict
    pipe_cls: type | None


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _snapshot_plan(trainer) -> _SnapshotPlan:
    """What a snapshot copies and how its tensors are named, worked out from the modules once per trainer (the
    trained parameters and the optimizer's groups stay the same objects for the trainer's life)."""
    plan = _PLANS.get(trainer)
    if plan is not None:
        return plan
    model = trained_module(trainer.adapter)
    named = list(model.named_parameters())
    params = [(name, p) for name, p in named if p.requires_grad or "lora_" in name]
    names = {id(p): name for name, p in named}
    group_fqns = [[names[id(p)] for p in group["params"]] for group in trainer.optimizer.param_groups]
    # peft's saved names of the LoRA tensors: from one run of its own naming, matched back by tensor identity
    by_id = {id(p): name for name, p in params}
    saved = lora_state(trainer, {name: p for name, p in params})
    lora_keys = {part: {key: by_id[id(value)] for key, value in keys.items()} for part, keys in saved.items()}
    pipe_cls = _lora_pipeline(trainer)
    targets = trainer.cfg.lora_targets or tuple(trainer.adapter.default_lora_targets)
    plan = _SnapshotPlan(params, group_fqns, lora_keys, _lora_metadata(trainer, targets, pipe_cls), pipe_cls)
    _PLANS[trainer] = plan
    return plan


def _lora_pipeline(trainer) -> type | None:
    """The diffusers pipeline class whose save_lora_weights writes the LoRA, or None for a model without a pipeline
    (a causal LM: its LoRA is written as a PEFT adapter folder)."""
    pipe = getattr(trainer.adapter, "pipe", None)
    if pipe is None:
        return None
    if not hasattr(type(pipe), "save_lora_weights"):
        raise TypeError(f"{type(pipe).__name__} has no save_lora_weights: diffusers cannot load LoRAs for it")
    return type(pipe)


def _lora_metadata(trainer, targets: tuple[str, ...], pipe_cls: type | None) -> dict:
    """The LoraConfig as a dict; a PEFT adapter folder's also names its base model (the causal LM's folder)."""
    metadata = lora_config(trainer.cfg, targets).to_dict()
    if pipe_cls is None:
        metadata["base_model_name_or_path"] = getattr(trainer.adapter, "source", None)
    return metadata


def _json_value(value):
    """JSON for what a LoraConfig's dict holds besides plain values (target_modules may be a set)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def write(state: LoraSnapshot, path: str) -> str:
    """Write a snapshot as the checkpoint folder `path` (the layout `save` writes; any thread)."""
    files = _Files(path.rstrip("/"), state.step)
    if state.copied is not None:
        state.copied.synchronize()
    trainable, optimizer = state.trainable, state.optimizer
    lora_layers = {
        part: {key: trainable[name].contiguous() for key, name in keys.items()}
        for part, keys in state.lora_keys.items()
    }
    if state.pipe_cls is None:  # a causal LM: the LoRA as a PEFT adapter folder (PeftModel / vLLM load it)
        files.put_tensors("lora/adapter_model.safetensors", lora_layers["transformer"])
        files.put("lora/adapter_config.json", json.dumps(state.lora_metadata, default=_json_value).encode())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            save_diffusers_lora(state.pipe_cls, tmp, lora_layers, state.lora_metadata)
            for name in sorted(os.listdir(tmp)):
                files.put_file(f"lora/{name}", os.path.join(tmp, name))
    files.put_tensors("trainable.safetensors", trainable)
    files.put_tensors("optimizer.safetensors", optimizer)
    files.put("optimizer.json", json.dumps(state.optimizer_groups).encode())
    files.put("trainer_state.json", json.dumps(state.trainer_state).encode())
    files.put_tensors("rng_rank0.safetensors", state.rng)
    files.close()
    return files.path


def save(trainer, path: str, *, step: int) -> str:
    """Write a checkpoint folder at `path` (see the module docstring); every rank must call it."""
    if trainer.cfg.lora and trainer.world_size == 1:
        return write(snapshot(trainer, step=step), path)
    path = path.rstrip("/")
    model = trained_module(trainer.adapter)
    rank = world()[0]
    if trainer.cfg.lora:
        trainable = trainable_state(trainer, all_lora=True)
        # collective: every rank gathers, only rank 0 receives the full (CPU) state
        optim_state = get_optimizer_state_dict(model, trainer.optimizer, options=_FULL)
        export_lora(trainer, f"{path}/lora", trainable)
        if rank == 0:
            optim_tensors, optim_rest = _split_optimizer(optim_state)
            _write_tensors(f"{path}/trainable.safetensors", trainable)
            _write_tensors(f"{path}/optimizer.safetensors", optim_tensors)
            _write(f"{path}/optimizer.json", json.dumps(optim_rest).encode())
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, trainer.optimizer)}
        _quiet_single_process_dcp()
        dcp.save(state, storage_writer=FsspecWriter(f"{path}/dcp", **fs.fsspec_options(path)))
    if rank == 0:
        _write(f"{path}/trainer_state.json", json.dumps(_trainer_state(trainer, step)).encode())
    _write_tensors(f"{path}/rng_rank{rank}.safetensors", _rng_state())
    barrier()
    if rank == 0:  # every rank's files are written: list them with their checksums (rank 0 commits after this)
        write_checksums(path)
    return path


def checked_state(path: str) -> dict:
    """The trainer_state.json of checkpoint `path`, after its files were checked against checksums.json
    (ValueError for a folder that is no diffrl checkpoint, CorruptCheckpoint naming a damaged file)."""
    path = path.rstrip("/")
    if not fs.exists(f"{path}/trainer_state.json"):
        raise ValueError(f"checkpoint path {path!r} has no trainer_state.json: not a diffrl trainer checkpoint")
    verify(path)
    return _load_json(f"{path}/trainer_state.json")


def load(trainer, path: str) -> int:
    """Restore weights, optimizer, LR schedule, counters and RNG from `path`; returns the saved step. Its files are
    checked against checksums.json first (CorruptCheckpoint naming a damaged one; nothing is changed then). The
    optimizer's hyper-parameters are the trainer's config's (a resume may change train.lr), not the saved ones."""
    path = path.rstrip("/")
    state = checked_state(path)
    if state["lora"] != trainer.cfg.lora:
        raise ValueError(
            f"checkpoint {path!r} was saved with lora={state['lora']} but TrainConfig.lora={trainer.cfg.lora}"
        )
    model = trained_module(trainer.adapter)
    if trainer.cfg.lora:
        # Every rank reads the same full state, yet without broadcast_from_rank0 set_model_state_dict and
        # set_optimizer_state_dict left most FSDP2 ranks' LoRA weights and Adam moments as initialised (torch 2.13,
        # sharded or replicated; tests/engines/train/test_fsdp.py): rank 0's state goes to every rank
        load_opts = StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=world()[1] > 1)
        trainable = _load_tensors(f"{path}/trainable.safetensors")
        osd = _join_optimizer(_load_tensors(f"{path}/optimizer.safetensors"), _load_json(f"{path}/optimizer.json"))
        set_model_state_dict(model, trainable, options=load_opts)
        set_optimizer_state_dict(model, trainer.optimizer, osd, options=load_opts)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, trainer.optimizer)}
        _quiet_single_process_dcp()
        dcp.load(sd, storage_reader=FsspecReader(f"{path}/dcp", **fs.fsspec_options(path)))
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, trainer.optimizer, sd["optim"])
    trainer.scheduler.load_state_dict({**trainer.scheduler.state_dict(), **state["scheduler"]})
    apply_optimizer_config(trainer.optimizer, trainer.scheduler, trainer.cfg)  # the config's lr, not the saved one
    trainer.optimizer_steps, trainer.updates = state["optimizer_steps"], state["updates"]
    trainer.restore_sync_state(state["policy_version"], state["stepped_since_sync"])
    random.setstate(_as_tuple(state["python_random"]))
    rng_file = f"{path}/rng_rank{world()[0]}.safetensors"
    if fs.exists(rng_file):
        _set_rng_state(_load_tensors(rng_file))
    else:
        warnings.warn(
            f"{rng_file} missing (checkpoint saved with {state['world_size']} ranks): this rank keeps its RNG state"
        )
    return int(state["step"])


def _as_tuple(value):
    """JSON turns random.getstate()'s tuples into lists; setstate needs the tuples back."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value
