"""The trainer's weights of one policy version, written where a vLLM server can load them (safetensors only).

- LoRA (`save_lora`): a PEFT adapter folder per version, `adapter_config.json` + `adapter_model.safetensors`, keys
  `base_model.model.<module>.lora_{A,B}.weight` as `PeftModel.save_pretrained` writes them; the server loads it with
  `POST /v1/load_lora_adapter` (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) under the name `policy-v<version>` and every
  completion request names the adapter of the version it samples, so one rollout never mixes policies.
- Full weights (`save_full`): the causal LM's whole state dict in its Hugging Face names (`model.safetensors`, with
  the model folder's config and tokenizer files beside it), reloaded in place by `POST /collective_rpc` with
  `{"method": "reload_weights", "kwargs": {"weights_path": <folder>}}` (VLLM_SERVER_DEV_MODE=1; vLLM's
  `GPUModelRunner.reload_weights(weights_path=...)`, vllm/v1/worker/gpu_model_runner.py, which the CPU runner
  inherits). Right for tests and small models; at real size vLLM's weight-transfer engine
  (`/init_weight_transfer_engine`, `/update_weights`, NCCL or IPC) would avoid the copies (docs/operations.md).

Where: `memory_folder` gives a folder on a tmpfs (`/dev/shm`) when it has room for the versions kept, so a version
goes from the trainer's memory to the server's without touching a disk; otherwise the caller writes under the run.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file
from torch import nn

MEMORY_ROOT = "/dev/shm"  # a tmpfs on Linux: its files are memory, never written to a disk
ADAPTER = "default"  # diffrl/engines/train/setup.py ADAPTER_NAME: the adapter the trainer trains
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def lora_state(model: nn.Module, adapter: str = ADAPTER) -> dict[str, torch.Tensor]:
    """The adapter's LoRA A/B matrices in PEFT's saved names (fp32 copies on the CPU)."""
    marker = f".{adapter}."
    out = {}
    for name, param in model.named_parameters():
        if "lora_" in name and marker in name:
            key = "base_model.model." + name.replace(marker, ".")
            out[key] = param.detach().to("cpu", torch.float32).contiguous()
    if not out:
        raise ValueError(
            f"the policy has no LoRA adapter {adapter!r}: train with train.lora=true, or sync full weights"
        )
    return out


def save_lora(model: nn.Module, folder: str, base_model: str, adapter: str = ADAPTER) -> str:
    """Write the adapter as a PEFT folder (atomic: written aside, then renamed); returns the folder."""
    config = getattr(model, "peft_config", {}).get(adapter)
    if config is None:
        raise ValueError(f"the policy has no peft config for adapter {adapter!r}")
    tmp = f"{folder}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(lora_state(model, adapter), os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    data = config.to_dict()
    data["base_model_name_or_path"] = base_model
    data["target_modules"] = sorted(data["target_modules"]) if data.get("target_modules") else None
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
        json.dump(data, f, indent=2, default=lambda v: sorted(v) if isinstance(v, set) else str(v))
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return folder


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights in Hugging Face names, LoRA merged in when there is one (base + scale * B @ A)."""
    state = {}
    lora = {name: p for name, p in model.named_parameters() if "lora_" in name}
    for name, tensor in model.state_dict().items():
        if "lora_" in name:
            continue
        key = name.replace(".base_layer.", ".")
        state[key] = tensor.detach().to("cpu").clone().contiguous()
    if lora:
        for module_name, module in model.named_modules():
            if hasattr(module, "lora_A") and ADAPTER in getattr(module, "lora_A", {}):
                delta = module.get_delta_weight(ADAPTER).detach().to("cpu")
                key = f"{module_name}.weight"
                state[key] = (state[key].float() + delta.float()).to(state[key].dtype)
    return state


def save_full(model: nn.Module, folder: str, model_dir: str) -> str:
    """Write the full weights (merged) as `model.safetensors` with the model folder's config/tokenizer files."""
    tmp = f"{folder}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    state = full_state(model)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the checkpoint holds the embedding only, as save_pretrained does
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    for name in _MODEL_FILES:
        if os.path.isfile(os.path.join(model_dir, name)):
            shutil.copy(os.path.join(model_dir, name), tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return folder


def weights_bytes(model: nn.Module, weight_sync: str) -> int:
    """What one version's folder holds, about: the LoRA matrices in fp32, or every weight at its dtype."""
    if weight_sync == "lora":
        return sum(p.numel() * 4 for name, p in model.named_parameters() if "lora_" in name)
    return sum(t.numel() * t.element_size() for name, t in model.state_dict().items() if "lora_" not in name)


def memory_folder(name: str, need_bytes: int, root: str = MEMORY_ROOT) -> str | None:
    """A folder `<root>/diffrl-<name>-<pid>` for the weight versions of this process when `root` is a folder with
    room for three versions (two kept, one being written) and 256 MiB to spare, else None. Folders of processes
    that are gone are removed first (a run killed before it could clean up)."""
    if not os.path.isdir(root) or not os.access(root, os.W_OK):
        return None
    for entry in os.listdir(root):
        pid = entry.rsplit("-", 1)[-1]
        if entry.startswith("diffrl-") and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    stat = os.statvfs(root)
    if stat.f_bavail * stat.f_frsize < 3 * need_bytes + (256 << 20):
        return None
    folder = os.path.join(root, f"diffrl-{name}-{os.getpid()}")
    os.makedirs(folder, exist_ok=True)
    return folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: is it there
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
