"""The behaviour copy of an asynchronous token run on the tiny Qwen3-Omni Thinker: it shares the trainer's frozen
tensors and buffers, owns its LoRA tensors, samples exactly as the policy at its version while the trainer's LoRA
moves, and a weight sync brings it to the trainer's weights in memory, versioned. The update that trains its samples
weighs them against the proximal policy (the trainer's weights before the update) with the rollout correction."""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.algorithms.catalog import get_algorithm
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout.tokens import TokenSampling, TransformersTokenEngine
from diffrl.engines.train.sync import behaviour_copy
from diffrl.engines.train.tokens import TokenTrainer
from diffrl.models.causal_lm.policy import CausalLMPolicy
from diffrl.models.causal_lm.tiny_thinker import tiny_thinker

SAMPLING = TokenSampling(max_new_tokens=4, temperature=1.0, batch_size=8)
PROMPTS = ["red circle. how many circles?"] * 4 + ["blue square. what color is the square?"] * 4
GROUPS = ["a"] * 4 + ["b"] * 4
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.0, 1.0, -0.5, 0.5])


def _sample(engine: TransformersTokenEngine, version: int):
    return engine.generate(PROMPTS, GROUPS, [0, 1, 2, 3] * 2, [11] * 4 + [12] * 4, SAMPLING, policy_version=version)


def _same(a, b) -> bool:
    return (
        a.responses == b.responses
        and all(torch.equal(x, y) for x, y in zip(a.response_ids, b.response_ids))
        and all(torch.equal(x, y) for x, y in zip(a.log_probs, b.log_probs))
    )


def _trainer(policy: CausalLMPolicy, correction: str = "off") -> TokenTrainer:
    cfg = TrainConfig(
        lora=True,
        lora_rank=8,
        lora_alpha=16,
        lr=3e-2,
        weight_decay=0.0,
        mini_batch_prompts=2,
        micro_batch_size=4,
        max_grad_norm=10.0,
        rollout_correction=correction,
        is_cap=2.0,
    )
    return TokenTrainer(policy, get_algorithm("grpo"), cfg, SAMPLING, group_size=4)


def test_behaviour_copy_samples_as_the_policy_at_its_version():
    policy = CausalLMPolicy(*tiny_thinker(0))
    trainer = _trainer(policy)
    rollout = TransformersTokenEngine(policy)
    trainer.update(_sample(rollout, 0), ADVANTAGES, rollout)  # LoRA B leaves its zero init: the adapter matters

    twin = behaviour_copy(policy)
    trainer.rollout_copy = twin
    behaviour = TransformersTokenEngine(twin)
    mine, theirs = dict(twin.model.named_parameters()), dict(policy.model.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, param in theirs.items():  # the base is the same storage; the LoRA tensors are the copy's own
        shared = mine[name].data_ptr() == param.data_ptr()
        assert shared != param.requires_grad, name
        assert not mine[name].requires_grad and torch.equal(mine[name], param)
    buffers = dict(policy.model.named_buffers())
    assert buffers and all(b is buffers[n] for n, b in twin.model.named_buffers())  # rotary tables: the same
    assert twin.model is not policy.model and twin.tokenizer is policy.tokenizer

    at_copy = _sample(behaviour, 0)
    assert _same(at_copy, _sample(rollout, 0))  # the copy is the policy at its version, bit for bit
    trainer.update(at_copy, ADVANTAGES, behaviour)  # the trainer's LoRA moves; the copy's does not
    assert not _same(_sample(rollout, 0), at_copy)
    assert _same(_sample(behaviour, 0), at_copy)

    version = trainer.policy_version
    synced = trainer.sync_weights(behaviour)  # in memory: the trained LoRA tensors into the copy
    lora = [p for p in policy.model.parameters() if p.requires_grad]
    assert synced["sync/num_tensors"] == len(lora) and synced["sync/bytes"] == sum(p.numel() * 4 for p in lora)
    assert trainer.policy_version == version + 1 == synced["sync/policy_version"] == behaviour.policy_version
    assert _same(_sample(behaviour, 1), _sample(rollout, 1))


@pytest.mark.parametrize("correction", ["tis", "mask"])
def test_a_stale_sample_is_weighed_against_the_proximal_policy(correction):
    """One epoch, one mini-batch (the single pass: no recompute) on samples of the behaviour copy one version behind:
    rollout_corr/ratio_* are exp(proximal - behaviour) over the response tokens, the proximal log-probs being the
    trainer's before the update (closed form from the two policies' own log-probs)."""
    policy = CausalLMPolicy(*tiny_thinker(0))
    trainer = _trainer(policy, correction)
    twin = behaviour_copy(policy)
    trainer.rollout_copy = twin
    behaviour = TransformersTokenEngine(twin)
    trainer.update(_sample(behaviour, 0), ADVANTAGES, behaviour)  # the trainer moves one step past the copy
    stale = _sample(behaviour, 0)
    ids, behaviour_log_probs, mask = stale.padded()
    with torch.no_grad():
        proximal = policy.log_probs(policy.inputs_from_ids(stale.prompt_ids, stale.image_paths), ids).float()
    ratio = torch.exp((proximal - behaviour_log_probs).double()[mask.bool()])
    assert float(ratio.max() - ratio.min()) > 1e-3  # the two policies differ

    metrics = trainer.update(stale, ADVANTAGES, behaviour)
    assert metrics["rollout_corr/ratio_mean"] == pytest.approx(float(ratio.mean()), rel=1e-4)
    assert metrics["rollout_corr/ratio_min"] == pytest.approx(float(ratio.min()), rel=1e-4)
    assert metrics["rollout_corr/ratio_max"] == pytest.approx(float(ratio.max()), rel=1e-4)
    corrected = ratio > 2.0 if correction == "tis" else ratio.log().abs() > math.log(2.0)
    assert metrics["rollout_corr/ratio_corrected"] == pytest.approx(float(corrected.double().mean()), abs=1e-6)
    # r = pi_theta / pi_prox is 1 in the single pass, so each token's loss is -A w, w the correction's weight of
    # pi_prox / pi_behav; GRPO's seq-mean-token-mean over each micro-batch of 4, then the mean of the two
    ratio_BT = torch.exp((proximal - behaviour_log_probs).double())
    w_BT = ratio_BT.clamp(max=2.0) if correction == "tis" else (ratio_BT.log().abs() <= math.log(2.0)).double()
    per_sequence = (-ADVANTAGES[:, None].double() * w_BT * mask).sum(1) / mask.sum(1)
    assert metrics["actor/pg_loss"] == pytest.approx(float(per_sequence.mean()), rel=1e-4)
