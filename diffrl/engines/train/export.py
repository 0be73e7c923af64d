"""Export a checkpoint as something plain diffusers loads, without diffrl (`diffrl export`).

    OUT/pytorch_lora_weights.safetensors   LoRA runs: `pipe.load_lora_weights(OUT)`; the LoRA config in the file's
                                           metadata names the base model (`base_model_name_or_path`)
    OUT/pytorch_lora_weights_transformer_2.safetensors
                                           Wan2.2 A14B runs also: the low-noise expert's LoRA, `pipe.load_lora_weights(
                                           OUT, weight_name=..., load_into_transformer_2=True)`
    OUT/pipeline/                          with merge (and always for full fine-tuning): the whole pipeline with the
                                           trained weights merged in, `DiffusionPipeline.from_pretrained(OUT/pipeline)`
    OUT/diffrl_export.json                 what was exported: base model, checkpoint, step, LoRA or full

A checkpoint folder is `runs/<name>/checkpoints/step_<k>/` (diffrl/engines/train/checkpoint.py): `lora/` holds a LoRA
run's adapter in diffusers' format, `dcp/` a full fine-tuning run's weights (torch.distributed.checkpoint shards).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffrl.engines.train.checkpoint import LORA_FILE, checked_state, lora_file_name

LORA_METADATA_KEY = "lora_adapter_metadata"  # where diffusers' save_lora_weights keeps the LoraConfig


@dataclass(frozen=True)
class Exported:
    """What `export_checkpoint` wrote (also saved as OUT/diffrl_export.json)."""

    base_model: str
    checkpoint: str
    step: int
    lora: bool
    lora_file: str | None
    pipeline_dir: str | None
    lora_file_2: str | None = None  # Wan2.2 A14B: the low-noise expert `transformer_2`'s LoRA


def export_checkpoint(
    checkpoint: str, out_dir: str, *, base_model: str, merge: bool = False, say: Callable[[str], None] = print
) -> Exported:
    """Write the checkpoint's LoRA (with `base_model` recorded) and, with `merge` or for full fine-tuning, the merged
    pipeline. `base_model` is what `DiffusionPipeline.from_pretrained` takes: a local folder or a Hub id."""
    state = checked_state(checkpoint)  # a damaged checkpoint is named, never exported
    os.makedirs(out_dir, exist_ok=True)
    lora_file = lora_file_2 = pipeline_dir = None
    if state["lora"]:
        lora_file = os.path.join(out_dir, LORA_FILE)
        write_lora_with_base(os.path.join(checkpoint, "lora", LORA_FILE), lora_file, base_model)
        say(f"LoRA: {lora_file} (base model {base_model})")
        second = os.path.join(checkpoint, "lora", lora_file_name("transformer_2"))
        if os.path.isfile(second):  # Wan2.2's low-noise expert
            lora_file_2 = os.path.join(out_dir, lora_file_name("transformer_2"))
            write_lora_with_base(second, lora_file_2, base_model)
            say(f"LoRA of transformer_2 (low-noise expert): {lora_file_2}")
    if merge or not state["lora"]:
        pipeline_dir = os.path.join(out_dir, "pipeline")
        say(f"merging into {base_model} ...")
        merged = merged_pipeline(base_model, checkpoint, lora_file, lora_file_2)
        merged.save_pretrained(pipeline_dir, safe_serialization=True)
        say(f"pipeline: {pipeline_dir}")
    result = Exported(
        base_model=base_model,
        checkpoint=os.path.abspath(checkpoint),
        step=int(state["step"]),
        lora=bool(state["lora"]),
        lora_file=lora_file,
        pipeline_dir=pipeline_dir,
        lora_file_2=lora_file_2,
    )
    with open(os.path.join(out_dir, "diffrl_export.json"), "w") as f:
        json.dump(asdict(result), f, indent=2)
    return result


def write_lora_with_base(source: str, target: str, base_model: str) -> None:
    """Copy a diffusers LoRA file, setting `base_model_name_or_path` in every LoRA config of its metadata."""
    if not os.path.isfile(source):
        raise ValueError(f"{source!r} does not exist: the checkpoint has no LoRA file")
    with safe_open(source, "pt") as f:
        metadata = dict(f.metadata() or {})
    if LORA_METADATA_KEY not in metadata:
        raise ValueError(
            f"{source!r} has no {LORA_METADATA_KEY!r} metadata: not written by diffusers' save_lora_weights"
        )
    config = json.loads(metadata[LORA_METADATA_KEY])
    for key in [k for k in config if k.endswith("base_model_name_or_path")]:
        config[key] = base_model
    metadata[LORA_METADATA_KEY] = json.dumps(config, indent=2, sort_keys=True)
    save_file(load_file(source), target, metadata=metadata)


def merged_pipeline(base_model: str, checkpoint: str, lora_file: str | None, lora_file_2: str | None = None):
    """The base pipeline (fp32) with the checkpoint's trained weights merged into its transformer (and Wan2.2's
    `transformer_2`)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(base_model, dtype=torch.float32)
    if lora_file is not None and not hasattr(pipe, "load_lora_weights"):
        return _merged_into_transformer(pipe, lora_file)
    if lora_file is not None:
        pipe.load_lora_weights(os.path.dirname(lora_file), weight_name=os.path.basename(lora_file))
        components = ["transformer"]
        if lora_file_2 is not None:
            pipe.load_lora_weights(
                os.path.dirname(lora_file_2), weight_name=os.path.basename(lora_file_2), load_into_transformer_2=True
            )
            components.append("transformer_2")
        pipe.fuse_lora(components=components)
        pipe.unload_lora_weights()
        return pipe
    import torch.distributed.checkpoint as dcp  # full fine-tuning: the weights are DCP shards

    # references to the parameters: loaded in place; two experts are saved under their component names
    second = getattr(pipe, "transformer_2", None)
    if second is None:
        target = {"model": pipe.transformer.state_dict()}
    else:
        experts = {"transformer": pipe.transformer, "transformer_2": second}
        target = {"model": {f"{n}.{k}": v for n, m in experts.items() for k, v in m.state_dict().items()}}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(target, checkpoint_id=os.path.join(checkpoint, "dcp"))
    except Exception as e:  # noqa: BLE001 - DCP raises several types for a missing or mismatched checkpoint
        raise ValueError(
            f"{checkpoint}: could not load its full fine-tuning weights into {base_model}'s transformer ({e}): "
            "was the checkpoint trained on another base model?"
        ) from None
    return pipe


def _merged_into_transformer(pipe, lora_file: str):
    """`pipe` with the LoRA of `lora_file` (diffusers' format, `transformer.`-prefixed keys) fused into its transformer,
    for pipelines diffusers gives no LoRA loader (HunyuanVideo-1.5, Stable Audio 3): the transformer takes it through
    diffusers' PeftAdapterMixin, added to its class where diffusers leaves it out (the class keeps its name and
    module, so the saved folder names the plain diffusers class)."""
    from diffusers.loaders.peft import PeftAdapterMixin

    transformer = pipe.transformer
    if not isinstance(transformer, PeftAdapterMixin):
        cls = type(transformer)
        transformer.__class__ = type(cls.__name__, (cls, PeftAdapterMixin), {"__module__": cls.__module__})
    transformer.load_lora_adapter(
        os.path.dirname(lora_file), weight_name=os.path.basename(lora_file), prefix="transformer"
    )
    transformer.fuse_lora()
    transformer.unload_lora()
    return pipe
