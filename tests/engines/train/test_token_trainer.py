"""TokenTrainer (diffrl/engines/train/tokens.py) with every token bundle of the catalog on a tiny Qwen3-Omni Thinker:
one update on sampled responses moves the policy towards the responses with the higher advantage (the sequence
log-prob of each group's best response rises against its worst's), as the needs say (a reference forward for KL and
DPO, by a frozen copy or with the LoRA adapter off; pairs; DAPO's varied groups), and the replay of the rollout's own
tokens reproduces its log-probs (rollout_corr), with gradient checkpointing too."""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.algorithms.catalog import get_algorithm, names_for
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout.tokens import TokenSampling, TransformersTokenEngine
from diffrl.engines.step.update import training_rows
from diffrl.engines.train.tokens import TokenTrainer
from diffrl.models.causal_lm.policy import CausalLMPolicy
from diffrl.models.causal_lm.tiny_thinker import tiny_thinker

SAMPLING = TokenSampling(max_new_tokens=4, temperature=1.0, batch_size=8)
PROMPTS = ["red circle. how many circles?", "blue square. what color is the square?"]


def _sequence_log_probs(policy: CausalLMPolicy, traj) -> torch.Tensor:
    ids, _, mask = traj.padded()
    with torch.no_grad():
        return (policy.log_probs(policy.inputs_from_ids(traj.prompt_ids, traj.image_paths), ids) * mask).sum(1)


@pytest.mark.parametrize(
    "name, overrides, lora",
    [(n, {}, False) for n in names_for(tokens=True)]
    + [("grpo", {"kl_coef": 0.04}, False), ("sequence_dpo", {}, True), ("gspo", {}, True)],
)
def test_one_update_prefers_the_higher_advantage_responses(name, overrides, lora):
    policy = CausalLMPolicy(*tiny_thinker(0))
    algorithm = get_algorithm(name, **overrides)
    cfg = TrainConfig(
        lora=lora,
        lora_rank=8,
        lora_alpha=16,
        lr=3e-2,
        weight_decay=0.0,
        mini_batch_prompts=2,
        micro_batch_size=8,
        max_grad_norm=10.0,
        gradient_checkpointing=lora,  # as the real-size recipe: the rollout must still match the replay (0.18 off once)
    )
    trainer = TokenTrainer(policy, algorithm, cfg, SAMPLING, group_size=4)
    rollout = TransformersTokenEngine(policy)
    traj = rollout.generate(
        [p for p in PROMPTS for _ in range(4)], ["a"] * 4 + ["b"] * 4, [0, 1, 2, 3] * 2, [11] * 8, SAMPLING
    )
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0])  # group b varies too: DAPO keeps both
    advantages = (rewards.view(2, 4) - rewards.view(2, 4).mean(1, keepdim=True)).view(-1)
    rows, _ = training_rows(algorithm, rewards, advantages, traj.group_ids, torch.ones(8, dtype=torch.bool))
    before = _sequence_log_probs(policy, traj)
    metrics = trainer.update(traj.select(rows), advantages[rows], rollout)
    after = _sequence_log_probs(policy, traj)

    assert (
        metrics["actor/skipped_steps"] == 0
        and math.isfinite(metrics["actor/grad_norm"])
        and metrics["actor/entropy"] > 0
    )
    if algorithm.needs.old_log_probs:  # same weights, same numerics: the rollout's log-probs are the old policy's
        assert metrics["rollout_corr/logprob_abs_diff_max"] < 1e-5
    if overrides.get("kl_coef"):
        assert metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # policy = reference before the step
    gain = after - before
    assert float(gain[0] - gain[1:4].mean()) > 0, (name, gain)  # group a: sample 0 was the right answer
    assert float(gain[[5, 7]].mean() - gain[[4, 6]].mean()) > 0, (name, gain)
    assert trainer.policy_version == 0 and trainer.sync_weights(rollout)["sync/policy_version"] == 1.0
    assert rollout.policy_version == 1


def test_entropy_metric_is_the_token_mean_entropy_before_the_step():
    """actor/entropy (summed on the device, read once at the update's end) is the mean over passes of each pass's
    masked token-mean entropy: with micro-batches of 4, two passes on the weights before the optimizer step (at a low
    temperature, so that the tiny random model's two passes differ clearly)."""
    sampling = TokenSampling(max_new_tokens=4, temperature=0.05, batch_size=8)
    policy = CausalLMPolicy(*tiny_thinker(0))
    cfg = TrainConfig(lora=False, lr=1e-3, mini_batch_prompts=2, micro_batch_size=4, shuffle=False)
    trainer = TokenTrainer(policy, get_algorithm("grpo"), cfg, sampling, group_size=4)
    rollout = TransformersTokenEngine(policy)
    traj = rollout.generate(
        [p for p in PROMPTS for _ in range(4)], ["a"] * 4 + ["b"] * 4, list(range(8)), [5] * 8, sampling
    )
    ids, _, mask = traj.padded()
    expected = []
    with torch.no_grad():
        for idx in ([0, 1, 2, 3], [4, 5, 6, 7]):
            width = int(mask[idx].sum(1).max())
            sub = traj.select(idx)
            inputs = policy.inputs_from_ids(sub.prompt_ids, sub.image_paths, sub.audio_paths)
            entropy = policy.replay(inputs, ids[idx, :width], temperature=sampling.temperature, entropy=True)[1]
            expected.append(float((entropy.cpu() * mask[idx, :width]).sum() / mask[idx, :width].sum()))
    metrics = trainer.update(traj, torch.tensor([1.0, -1.0, 0.5, -0.5] * 2), rollout)
    assert metrics["actor/entropy"] == pytest.approx(sum(expected) / 2, rel=1e-5)
    assert min(expected) > 0 and abs(expected[0] - expected[1]) > 1e-3 * max(
        expected
    )  # two different passes, both counted


@pytest.mark.parametrize("lora", [False, True])
def test_checkpoint_resumes_the_next_update_exactly_and_lora_is_a_peft_folder(tmp_path, lora):
    """Save after one update, update again; a fresh trainer that loads the checkpoint makes the same second update
    (weights, optimizer moments, schedule and RNG restored). A LoRA checkpoint's lora/ loads with PEFT."""
    from peft import PeftModel
    from safetensors.torch import load_file

    cfg = TrainConfig(lora=lora, lora_rank=4, lora_alpha=8, lr=1e-2, mini_batch_prompts=2, micro_batch_size=8)
    algorithm = get_algorithm("grpo")
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 1.0, -1.0, 0.0])

    def trainer_and_batch():
        policy = CausalLMPolicy(*tiny_thinker(0))
        trainer = TokenTrainer(policy, algorithm, cfg, SAMPLING, group_size=4)
        rollout = TransformersTokenEngine(policy)
        traj = rollout.generate(
            [p for p in PROMPTS for _ in range(4)], ["a"] * 4 + ["b"] * 4, [0, 1, 2, 3] * 2, [5] * 8, SAMPLING
        )
        return trainer, rollout, traj

    trainer, rollout, traj = trainer_and_batch()
    trainer.update(traj, advantages, rollout)
    trainer.save_checkpoint(str(tmp_path / "ckpt"), step=1)
    trainer.update(traj, advantages, rollout)
    expected = {n: p.detach().clone() for n, p in trainer.adapter.model.named_parameters() if p.requires_grad}

    again, rollout2, _ = trainer_and_batch()
    assert again.load_checkpoint(str(tmp_path / "ckpt")) == 1
    again.update(traj, advantages, rollout2)
    for name, p in again.adapter.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=0)
    if lora:
        saved = load_file(str(tmp_path / "ckpt" / "lora" / "adapter_model.safetensors"))
        peft = dict(
            PeftModel.from_pretrained(
                CausalLMPolicy(*tiny_thinker(0)).model, str(tmp_path / "ckpt" / "lora")
            ).named_parameters()
        )
        assert saved and all(
            torch.equal(peft["base_model.model." + k.replace(".weight", ".default.weight")], v)
            for k, v in saved.items()
        )
