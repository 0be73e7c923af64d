"""The warm start of omni_quick (diffrl/shapes/pretrain/thinker.py): a short run writes a Thinker folder of
fp16 safetensors that loads offline; the shipped one (diffrl/models/reference/shapes-thinker) answers the held-out
questions as its pretrain_summary.json says."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from diffrl.flows.build import resolve_model_path
from diffrl.models.causal_lm.policy import CausalLMPolicy
from diffrl.shapes.pretrain.thinker import PretrainConfig, greedy_accuracy, pretrain
from diffrl.shapes.questions import HELDOUT_SEED, HELDOUT_SIZE, scene_questions


def test_short_run_writes_a_loadable_fp16_thinker(tmp_path):
    summary = pretrain(PretrainConfig(steps=3, batch=8, num_train=32), str(tmp_path))
    with open(tmp_path / "pretrain_summary.json") as f:
        assert json.load(f)["greedy_accuracy_after"] == summary["greedy_accuracy_after"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    policy = CausalLMPolicy.from_pretrained(str(tmp_path))  # runs load it in fp32
    assert type(policy.model).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    assert next(policy.model.parameters()).dtype == torch.float32


def test_shipped_warm_start_answers_as_its_summary_says():
    folder = resolve_model_path("reference:shapes-thinker")
    files = os.listdir(folder)
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]  # nothing to unpickle
    assert sum(os.path.getsize(os.path.join(folder, f)) for f in files) < 2**20  # under 1 MB
    with open(os.path.join(folder, "pretrain_summary.json")) as f:
        summary = json.load(f)
    heldout = scene_questions(HELDOUT_SIZE, HELDOUT_SEED, None).records
    assert greedy_accuracy(CausalLMPolicy.from_pretrained(folder), heldout) == summary["greedy_accuracy_after"]
