"""Packed replay (diffrl/models/causal_lm/packing.py): a micro-batch's sequences in one row give the padded replay's
log-probs and gradients (fp32, CPU) on a tiny Qwen3, a tiny Qwen3-MoE and a tiny Qwen3-Omni Thinker, under the packed
sdpa attention and transformers' eager block-diagonal mask, with gradient checkpointing too; the MoE models run
transformers' grouped-GEMM experts, which give the eager expert loop's log-probs and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from diffrl.models.causal_lm.packing import PACKED_SDPA, pack, text_config
from diffrl.models.causal_lm.policy import CausalLMPolicy
from diffrl.models.causal_lm.tiny import tiny_qwen3_config
from diffrl.models.causal_lm.tiny_thinker import tiny_thinker
from diffrl.models.tokenizers import QWEN3_CHAT_TEMPLATE, qwen_tokenizer

PROMPT_LENGTHS, RESPONSE_LENGTHS = (5, 11, 3, 7), (6, 2, 9, 1)


def _qwen3(tokenizer) -> torch.nn.Module:
    return Qwen3ForCausalLM(tiny_qwen3_config(tokenizer))


def _qwen3_moe(tokenizer) -> torch.nn.Module:
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3MoeForCausalLM(config)


def _policy(kind: str, attention: str = "sdpa") -> CausalLMPolicy:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if kind == "thinker":
            model, tokenizer, processor = tiny_thinker(0)
        else:
            tokenizer, processor = qwen_tokenizer(chat_template=QWEN3_CHAT_TEMPLATE), None
            model = {"qwen3": _qwen3, "qwen3_moe": _qwen3_moe}[kind](tokenizer)
    if attention != "sdpa":
        model.set_attn_implementation(attention)
    return CausalLMPolicy(model.train(), tokenizer, processor)


def _sequences(policy: CausalLMPolicy) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    vocab = len(policy.tokenizer)
    prompts = [torch.randint(1, vocab, (n,), generator=gen) for n in PROMPT_LENGTHS]
    responses = [torch.randint(1, vocab, (n,), generator=gen) for n in RESPONSE_LENGTHS]
    return prompts, responses


def _loss_and_grads(policy, log_probs, mask) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    weights = torch.linspace(-1.0, 2.0, mask.numel()).view(mask.shape)  # every token's gradient counts differently
    policy.model.zero_grad(set_to_none=True)
    (log_probs * mask * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return log_probs.detach(), grads


def _padded(policy, prompts, responses):
    width = max(RESPONSE_LENGTHS)
    ids = torch.zeros((len(responses), width), dtype=torch.long)
    mask = torch.zeros((len(responses), width))
    for i, r in enumerate(responses):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1.0
    log_probs, entropy = policy.replay(policy.inputs_from_ids(prompts, [()] * len(prompts)), ids, entropy=True)
    return *_loss_and_grads(policy, log_probs, mask), entropy, mask


def _packed(policy, prompts, responses):
    log_probs, entropy = policy.replay_packed(prompts, responses, entropy=True)
    mask = pack(prompts, responses).mask.float()
    return *_loss_and_grads(policy, log_probs, mask), entropy, mask


@pytest.mark.parametrize(
    "kind, attention, checkpointing",
    [
        ("qwen3", "sdpa", False),
        ("qwen3", "eager", False),
        ("qwen3_moe", "sdpa", False),
        ("qwen3_moe", "sdpa", True),
        ("thinker", "sdpa", False),
        ("thinker", "eager", True),
    ],
)
def test_packed_replay_gives_the_padded_log_probs_and_gradients(kind, attention, checkpointing):
    policy = _policy(kind, attention)
    expected = PACKED_SDPA if attention == "sdpa" else attention
    assert text_config(policy.model)._attn_implementation == expected and policy.packs([()] * 4)
    if checkpointing:
        policy.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompts, responses = _sequences(policy)
    padded, padded_grads, padded_entropy, mask = _padded(policy, prompts, responses)
    packed, packed_grads, packed_entropy, _ = _packed(policy, prompts, responses)

    trained = mask.bool()
    torch.testing.assert_close(packed[trained], padded[trained], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed_entropy[trained], padded_entropy[trained], atol=1e-5, rtol=0)
    assert packed[~trained].abs().max() == 0 and packed_entropy[~trained].abs().max() == 0
    assert padded_grads.keys() == packed_grads.keys() and len(padded_grads) > 10
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_sequences_do_not_see_each_other():
    """A sequence's packed log-probs are the same whatever is packed before it."""
    policy = _policy("qwen3")
    prompts, responses = _sequences(policy)
    with torch.no_grad():
        together = policy.replay_packed(prompts, responses)[0]
        alone = policy.replay_packed(prompts[-1:], responses[-1:])[0]
    torch.testing.assert_close(together[-1, : RESPONSE_LENGTHS[-1]], alone[0], atol=1e-5, rtol=0)


def test_pack_lays_sequences_end_to_end():
    prompts = [torch.tensor([11, 12]), torch.tensor([21, 22, 23])]
    responses = [torch.tensor([13, 14, 15]), torch.tensor([24])]
    packed = pack(prompts, responses)
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 15, 21, 22, 23, 24]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert packed.segment_lengths == (5, 4)
    # logits at position j predict token j + 1: 13 is predicted at 12's position (1), 24 at 23's (7)
    assert packed.logit_index.tolist() == [[1, 2, 3], [7, 0, 0]]
    assert packed.mask.tolist() == [[True, True, True], [True, False, False]]


def test_prompts_with_images_or_audio_replay_padded():
    policy = _policy("thinker")
    assert not policy.packs([("a.png",), ()]) and not policy.packs([(), ()], [(), ("a.wav",)])


@pytest.mark.parametrize("kind", ["qwen3_moe", "thinker"])
def test_grouped_mm_experts_give_the_eager_loops_log_probs_and_gradients(kind):
    policy = _policy(kind)
    assert policy.experts_implementation == "grouped_mm"
    assert text_config(policy.model)._experts_implementation == "grouped_mm"
    prompts, responses = _sequences(policy)
    grouped, grouped_grads, _, mask = _packed(policy, prompts, responses)
    policy.model.set_experts_implementation("eager")
    assert text_config(policy.model)._experts_implementation == "eager"
    eager, eager_grads, _, _ = _packed(policy, prompts, responses)

    trained = mask.bool()
    torch.testing.assert_close(grouped[trained], eager[trained], atol=1e-5, rtol=0)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_a_dense_model_has_no_experts_implementation():
    assert _policy("qwen3").experts_implementation is None
