"""Janus-Pro image generation as a token policy (diffrl.models.janus.policy) on the tiny random Janus folder: sampling
equals transformers' own `generate(..., generation_mode="image")` for a seed, the recorded log-probs are those of the
guided distribution and the teacher-forced replay reproduces them, decoding equals JanusImageProcessor's postprocess,
and LoRA reaches only the language model."""

from __future__ import annotations

import os

import pytest
import torch
from transformers.models.janus.image_processing_pil_janus import JanusImageProcessorPil

from diffrl.configs.train import TrainConfig
from diffrl.engines.train.setup import add_lora
from diffrl.models.causal_lm.policy import SamplingParams, TokenPrompt
from diffrl.models.janus.policy import JanusImagePolicy, is_janus_folder

PROMPTS = [TokenPrompt("a red circle"), TokenPrompt("two blue squares above a green triangle")]


@pytest.fixture(scope="module")
def folder(tiny_model):
    return tiny_model("janus")


@pytest.fixture(scope="module")
def policy(folder):
    return JanusImagePolicy.from_pretrained(folder)


def test_tiny_folder_is_small_safetensors_with_16_image_tokens(folder, policy):
    files = os.listdir(folder)
    assert "model.safetensors" in files and not any(f.endswith(".bin") for f in files)
    assert sum(os.path.getsize(os.path.join(folder, f)) for f in files) < 10 * 2**20
    assert is_janus_folder(folder) and policy.num_image_tokens == 16 and policy.guidance_scale == 5.0


@pytest.mark.parametrize("n", [1, 2])
def test_sample_equals_transformers_image_generation(policy, n):
    """Same seed, prompt, CFG scale and temperature: the same image tokens as JanusForConditionalGeneration.generate
    (its static cache, its CFG logits processor; top_k 0 so that no top-k warper truncates the 256-entry codebook)."""
    enc = policy.encode([PROMPTS[1]])
    torch.manual_seed(11)
    upstream = policy.model.generate(
        enc.input_ids,
        attention_mask=enc.attention_mask,
        generation_mode="image",
        do_sample=True,
        num_return_sequences=n,
        top_k=0,
        temperature=0.8,
        guidance_scale=5.0,
    )
    ours = policy.sample([PROMPTS[1]], SamplingParams(n=n, max_tokens=16, temperature=0.8, seed=11))
    assert ours.response_ids.tolist() == upstream.tolist()


def test_log_probs_are_the_guided_distribution_and_replay_reproduces_them(policy):
    samples = policy.sample(PROMPTS, SamplingParams(n=2, max_tokens=16, temperature=0.7, seed=3))
    assert samples.response_ids.shape == (4, 16) and bool(samples.mask.all())
    with torch.no_grad():
        replay, entropy = policy.replay(samples.prompts, samples.response_ids, temperature=0.7, entropy=True)
    torch.testing.assert_close(replay, samples.log_probs, rtol=0, atol=1e-5)
    assert bool((entropy > 0).all())

    # closed form, one prompt alone (no padding), position by position from the cond and uncond rows' logits
    row = 3  # the second prompt (the longer one: no left padding), second sample
    ids = policy.encode([PROMPTS[1]]).input_ids
    tokens = samples.response_ids[row]
    with torch.no_grad():
        rows = torch.cat([ids, policy.unconditional_ids(ids)])
        embeds = torch.cat(
            [
                policy.model.get_input_embeddings()(rows),
                policy.model.prepare_embeddings_for_image_generation(tokens[:-1].repeat(2, 1)),
            ],
            dim=1,
        )
        hidden = policy.model.model.language_model(inputs_embeds=embeds).last_hidden_state[:, ids.shape[1] - 1 :]
        cond, uncond = policy.model.model.generation_head(hidden).float()
    expected = torch.log_softmax((uncond + 5.0 * (cond - uncond)) / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(samples.log_probs[row], expected, rtol=0, atol=1e-5)
    # the short prompt was left-padded in the batch; its log-probs equal those of a batch of its own
    alone = policy.replay(policy.encode([PROMPTS[0]]), samples.response_ids[:1], temperature=0.7)[0]
    torch.testing.assert_close(alone.detach(), samples.log_probs[:1], rtol=0, atol=1e-5)


def test_unconditional_prompt_keeps_only_bos_and_begin_of_image(policy):
    ids = policy.encode(PROMPTS).input_ids
    uncond = policy.unconditional_ids(ids)
    assert bool((uncond[:, -1] == policy.boi_token_id).all())
    kept = (uncond == policy.bos_token_id) | (uncond == policy.boi_token_id)
    assert bool((uncond[~kept] == policy.pad_token_id).all()) and int(kept.sum()) == 4


def test_greedy_sampling_is_the_argmax_and_repeats(policy):
    a = policy.sample(PROMPTS[:1], SamplingParams(n=2, max_tokens=16, temperature=0, seed=0))
    b = policy.sample(PROMPTS[:1], SamplingParams(n=1, max_tokens=16, temperature=0, seed=5))
    assert a.response_ids[0].tolist() == a.response_ids[1].tolist() == b.response_ids[0].tolist()
    torch.testing.assert_close(a.log_probs, policy.replay(a.prompts, a.response_ids)[0].detach(), rtol=0, atol=1e-5)


def test_decode_equals_the_image_processors_postprocess(folder, policy):
    tokens = policy.sample(PROMPTS, SamplingParams(n=1, max_tokens=16, seed=1)).response_ids
    images = policy.decode(tokens)
    assert images.shape == (2, 64, 64, 3) and images.dtype == torch.uint8
    with torch.no_grad():
        pixels = policy.model.decode_image_tokens(tokens)
    processor = JanusImageProcessorPil.from_pretrained(folder)
    # the PIL processor infers channels-first for these arrays: hand it (3, H, W), as transformers' own tests do
    ref = processor.postprocess(list(pixels.float().permute(0, 3, 1, 2)), return_tensors="np")["pixel_values"]
    diff = (images.int() - torch.from_numpy(ref).permute(0, 2, 3, 1).int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01  # float rounding at a level's edge


def test_lora_reaches_the_language_model_only(folder):
    policy = JanusImagePolicy.from_pretrained(folder)
    targets = policy.default_lora_targets
    assert len(targets) == 2 * 4 and all(".language_model.layers." in t for t in targets)
    add_lora(policy.model, TrainConfig(lora=True, lora_rank=4, lora_alpha=8), targets)
    trained = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n and ".language_model." in n for n in trained)
    samples = policy.sample(PROMPTS[:1], SamplingParams(n=2, max_tokens=16, seed=2))
    policy.model.train()
    policy.replay(samples.prompts, samples.response_ids)[0].sum().backward()
    grads = {n: p.grad for n, p in policy.model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    assert any(float(g.abs().max()) > 0 for n, g in grads.items() if "lora_A" in n or "lora_B" in n)


def test_unsupported_settings_are_value_errors(policy):
    with pytest.raises(ValueError, match="top_p 1"):
        policy.sample(PROMPTS, SamplingParams(max_tokens=16, top_p=0.9))
    with pytest.raises(ValueError, match="rollout.max_new_tokens to 16"):
        policy.sample(PROMPTS, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="text prompts only"):
        policy.encode([TokenPrompt("a cat", images=("x.png",))])
    with pytest.raises(ValueError, match="not a Janus folder"):
        JanusImagePolicy.from_pretrained("/nonexistent")
