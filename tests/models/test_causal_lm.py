"""The autoregressive policy adapter (diffrl.models.causal_lm.policy) on the tiny Qwen3-Omni Thinker (real transformers
classes, random weights, built offline): sampled per-token log-probs equal a teacher-forced recompute, with images,
n samples per prompt, stop strings and max_tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.models.causal_lm.policy import CausalLMPolicy, SamplingParams, TokenPrompt
from diffrl.models.tiny import build_tiny


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> CausalLMPolicy:
    folder = build_tiny("qwen3_omni", str(tmp_path_factory.mktemp("thinker")), seed=0)
    return CausalLMPolicy.from_pretrained(folder)


@pytest.fixture(scope="module")
def image_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("images") / "scene.png")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    return path


def test_sampled_log_probs_match_the_replay(policy, image_path):
    prompts = [TokenPrompt("how many red circles?", (image_path,)), TokenPrompt("a cat", ())]
    params = SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=3)
    out = policy.sample(prompts, params)
    assert out.response_ids.shape == out.log_probs.shape == out.mask.shape == (4, out.response_ids.shape[1])
    assert out.response_ids.shape[1] <= 6
    assert torch.equal(out.mask.sum(1), out.lengths) and (out.lengths >= 1).all()
    # prompt-major rows: each prompt's n samples share its (left-padded) prompt ids
    assert torch.equal(out.prompts.input_ids[0], out.prompts.input_ids[1])
    assert out.prompts.vision["image_grid_thw"].shape == (2, 3)  # the image of prompt 0, once per sample
    with torch.no_grad():
        replay = policy.log_probs(out.prompts, out.response_ids, temperature=0.8)
    torch.testing.assert_close(replay * out.mask, out.log_probs, rtol=0, atol=1e-5)
    again = policy.sample(prompts, params)
    assert torch.equal(again.response_ids, out.response_ids)  # seeded
    stopped = policy.sample(prompts, SamplingParams(n=2, max_tokens=6, top_p=0.9, stop=("e",), seed=3))
    for row, length in zip(stopped.response_ids.tolist(), stopped.lengths.tolist()):
        text = policy.tokenizer.decode(row[:length])
        assert "e" not in policy.tokenizer.decode(row[: length - 1])  # it ends at the first stop
        assert "e" in text or length == 6 or row[length - 1] in policy.eos_token_ids


def test_replay_is_differentiable(policy):
    out = policy.sample([TokenPrompt("a dog")], SamplingParams(n=2, max_tokens=3, seed=1))
    log_probs = policy.log_probs(out.prompts, out.response_ids)
    (log_probs * out.mask).sum().backward()
    grads = [p.grad for p in policy.model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    policy.model.zero_grad(set_to_none=True)


def test_lengths_end_at_eos_or_a_stop_string(policy):
    tok = policy.tokenizer
    eos = policy.eos_token_ids[0]
    ids = tok("red circle blue", add_special_tokens=False)["input_ids"]
    response = torch.tensor([ids + [eos, 0, 0], ids + [5, 6, 7]])
    assert policy.response_lengths(response).tolist() == [len(ids) + 1, len(ids) + 3]
    first = len(tok("red", add_special_tokens=False)["input_ids"])
    assert policy.response_lengths(response, ("red",)).tolist() == [first, first]


def test_sampling_params_check_their_fields():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    assert SamplingParams(temperature=0.0).temperature == 0.0  # 0 decodes greedily (validation, omni_quick)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)


def test_audio_prompts_replay_to_the_sampled_log_probs(policy, image_path, sine_wav):
    """Audio clips (alone, two in a row, next to an image) expand into one <|audio_pad|> per tower output as
    Qwen3OmniMoeProcessor expands them, and the replay of the stored ids and paths gives the sampled log-probs."""
    a, b = sine_wav("a.wav", 440, seconds=0.5), sine_wav("b.wav", 1000, seconds=1.23)
    prompts = [
        TokenPrompt("what do you hear?", (), (a,)),
        TokenPrompt("and these?", (image_path,), (b, a)),
        TokenPrompt("a cat"),
    ]
    params = SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=5)
    out = policy.sample(prompts, params)
    audio_pad = policy.tokenizer.convert_tokens_to_ids(policy.tokenizer.audio_token)
    assert (out.prompts.input_ids == audio_pad).sum(1).tolist() == [7, 7, 16 + 7, 16 + 7, 0, 0]  # 0.5 s: 7, 1.23 s: 16
    assert out.prompts.audio["audios_per_row"].tolist() == [1, 1, 2, 2, 0, 0]
    stored = [ids[mask.bool()] for ids, mask in zip(out.prompts.input_ids, out.prompts.attention_mask)]
    rows = [p for p in prompts for _ in range(params.n)]
    inputs = policy.inputs_from_ids(stored, [p.images for p in rows], [p.audios for p in rows])
    with torch.no_grad():
        replay = policy.log_probs(inputs, out.response_ids, temperature=0.8)
    torch.testing.assert_close(replay * out.mask, out.log_probs, rtol=0, atol=1e-5)


def test_the_audio_changes_the_logits(policy, sine_wav):
    """Two clips of one length (the same prompt ids) give other log-probs for the same response; one clip twice the
    same ones."""
    clips = [sine_wav("low.wav", 300), sine_wav("high.wav", 3000), sine_wav("low_again.wav", 300)]
    inputs = policy.encode([TokenPrompt("what do you hear?", (), (c,)) for c in clips])
    assert torch.equal(inputs.input_ids[0], inputs.input_ids[1])
    response = torch.tensor([policy.tokenizer("a red circle", add_special_tokens=False)["input_ids"]] * 3)
    with torch.no_grad():
        low, high, low_again = policy.log_probs(inputs, response)
    assert (low - high).abs().max() > 1e-3
    torch.testing.assert_close(low, low_again, rtol=0, atol=1e-6)


def test_audio_inputs_that_cannot_be_used_are_errors(policy, sine_wav):
    clip = sine_wav("clip.wav", 440)
    no_extractor = CausalLMPolicy(policy.model, policy.tokenizer, policy.image_processor, source="folder")
    with pytest.raises(ValueError, match="'folder': prompts play audio but the model folder has no audio feature"):
        no_extractor.encode([TokenPrompt("hi", (), (clip,))])
    with pytest.raises(ValueError, match="8000 Hz audio"):
        policy.encode([TokenPrompt("hi", (), (sine_wav("phone.wav", 440, rate=8000),))])
    # a stored row whose clip changed length since it was sampled: its ids hold other placeholders
    ids = policy.encode([TokenPrompt("hi", (), (clip,))]).input_ids
    with pytest.raises(ValueError, match="hold 7 audio tokens, their clips give 13 now"):
        policy.inputs_from_ids([ids[0]], [()], [(sine_wav("longer.wav", 440, seconds=1.0),)])
