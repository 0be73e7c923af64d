"""Packed sequences for the replay: a micro-batch's prompt+response sequences laid end to end in one row, without
padding, each attending only to itself, and the fastest experts path of a MoE model.

Legend: b sequences, N packed tokens (the sum of their lengths), T response tokens of the longest response.

A packed forward gives transformers `position_ids` that restart at 0 with each sequence and no attention mask:
transformers reads the restarts as sequence boundaries (its packed-sequence path). Under "eager" it builds a
block-diagonal causal mask, under flash attention it runs the varlen kernel. Under "sdpa" a block-diagonal mask would
make every query score the whole packed row (b^2 x the attention of b separate rows), so a model that uses sdpa is
switched to PACKED_SDPA: torch's sdpa run causally on each sequence's slice of the row (the segment lengths travel with
the forward's keyword arguments, so a checkpointed layer's recompute in the backward sees them too), and plain sdpa,
mask and all, for every forward that is not packed (`generate`).

Packing is used for the model types whose transformers code was checked to read packed positions (PACKED_MODEL_TYPES)
and for text-only inputs; prompts with images or audio (M-RoPE positions of an image grid, encoder outputs scattered
into the row) run padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "diffrl_packed_sdpa"
# Qwen3, Qwen3-MoE and the Qwen3-Omni Thinker (text-only): their text models build the causal mask from position_ids
PACKED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_omni_moe_thinker")


def _packed_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    segment_lengths: tuple[int, ...] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, once per packed sequence when `segment_lengths` is given: query (1, H, N, D) and
    key/value (1, H_kv, N, D) are cut into the sequences' slices, each attends causally to itself; output (1, N, H, D)
    as transformers' attention functions return it."""
    if segment_lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    assert attention_mask is None and query.shape[0] == 1 and sum(segment_lengths) == query.shape[2]
    kwargs.pop("is_causal", None)
    outputs, start = [], 0
    for length in segment_lengths:
        part = slice(start, start + length)
        out, _ = sdpa_attention_forward(
            module, query[:, :, part], key[:, :, part], value[:, :, part], None, is_causal=True, **kwargs
        )
        outputs.append(out)
        start += length
    return torch.cat(outputs, dim=1), None


def _packed_sdpa_mask(*, attention_mask: torch.Tensor | None = None, q_length: int, kv_length: int, **kwargs):
    """No mask for a forward over whole sequences without padding (a packed forward: its attention cuts the row into
    sequences; an unpacked one: causal); transformers' sdpa mask for every other forward (padding, a KV cache)."""
    if attention_mask is None and q_length == kv_length and kwargs.get("q_offset", 0) == 0:
        return None
    return sdpa_mask(attention_mask=attention_mask, q_length=q_length, kv_length=kv_length, **kwargs)


AttentionInterface.register(PACKED_SDPA, _packed_sdpa_attention)
AttentionMaskInterface.register(PACKED_SDPA, _packed_sdpa_mask)


def model_type(model: nn.Module) -> str:
    return getattr(model.config, "model_type", "")


def supports_packing(model: nn.Module) -> bool:
    """Whether the model's forward runs packed sequences (module docstring): its type was checked."""
    return model_type(model) in PACKED_MODEL_TYPES


def text_config(model: nn.Module):
    """The config of the model's text decoder (the Thinker's text_config, a causal LM's own config)."""
    return model.config.get_text_config()


def use_packed_sdpa(model: nn.Module) -> None:
    """Switch a packable model's text decoder from sdpa to PACKED_SDPA (the same kernels for every forward that is not
    packed); other attention implementations (eager, flash) read packed positions themselves and stay."""
    if not supports_packing(model) or text_config(model)._attn_implementation != "sdpa":
        return
    if text_config(model) is model.config:
        model.set_attn_implementation(PACKED_SDPA)
    else:  # the Thinker: its text model only (the vision and audio towers keep sdpa)
        model.set_attn_implementation({"text_config": PACKED_SDPA})


def use_grouped_mm_experts(model: nn.Module) -> str | None:
    """Select transformers' grouped-GEMM experts (one grouped matmul over all experts' tokens instead of a loop over
    the experts) for a MoE model whose installed transformers offers it; returns the experts implementation now in
    use, None for a dense model or a transformers without the setting."""
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    if can_set is None or not can_set() or not hasattr(model, "set_experts_implementation"):
        return None
    config = text_config(model)
    if getattr(config, "num_experts", 0) <= 1:
        return None
    if config._experts_implementation != "grouped_mm":
        model.set_experts_implementation("grouped_mm")
    return text_config(model)._experts_implementation


@dataclass
class PackedBatch:
    """b prompt+response sequences in one row: input_ids and position_ids (1, N), segment_lengths (b,); logit_index
    (b, T) the row position whose logits predict each response token (0 past a response's end), mask (b, T)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_lengths: tuple[int, ...]
    logit_index: torch.Tensor
    mask: torch.Tensor


def pack(prompt_ids: list[torch.Tensor], response_ids: list[torch.Tensor]) -> PackedBatch:
    """Lay the sequences (prompt i then response i) end to end; position_ids restart at 0 with each."""
    sequences = [torch.cat([p.long(), r.long()]) for p, r in zip(prompt_ids, response_ids)]
    lengths = tuple(len(s) for s in sequences)
    width = max((len(r) for r in response_ids), default=0)
    logit_index = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    start = 0
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        # the logits at position j predict token j + 1: response token t is predicted by the row's position of
        # prompt token P_i - 1 + t (the last prompt token predicts the first response token)
        logit_index[i, : len(r)] = start + len(p) - 1 + torch.arange(len(r))
        mask[i, : len(r)] = True
        start += lengths[i]
    positions = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
    return PackedBatch(torch.cat(sequences)[None], positions[None], lengths, logit_index, mask)
