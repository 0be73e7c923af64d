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


def _sampled(sampling: TokenSampling):
    policy = CausalLMPolicy(*tiny_thinker(0))
    traj = TransformersTokenEngine(policy).generate(
        [p for p in PROMPTS for _ in range(4)], ["a"] * 4 + ["b"] * 4, list(range(8)), [7] * 8, sampling
    )
    return traj, torch.tensor([1.0, -1.0, 0.5, -0.5, 0.3, -0.3, 1.0, -1.0])


def _trained(traj, advantages, **overrides) -> tuple[dict[str, float], dict[str, torch.Tensor], TokenTrainer]:
    """One GSPO update of a fresh tiny Thinker (LoRA) on `traj`, with no rollout engine: the old policy's log-probs
    are never the rollout's, so the trainer recomputes them unless the step is a single pass."""
    policy = CausalLMPolicy(*tiny_thinker(0))
    settings = {"lora_rank": 8, "lora_alpha": 16, "lr": 3e-2, "mini_batch_prompts": 2, "micro_batch_size": 3}
    cfg = TrainConfig(**{**settings, **overrides})
    trainer = TokenTrainer(policy, get_algorithm("gspo"), cfg, SAMPLING, group_size=4)
    metrics = trainer.update(traj, advantages, None)
    return metrics, {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}, trainer


def test_a_single_pass_skips_the_recompute_and_trains_as_it():
    """One epoch, one mini-batch: the replay's own log-probs are the old policy's, no recompute pass runs, and the
    update (weights, loss, the rollout/trainer gap) is the one that recomputes them."""
    traj, advantages = _sampled(SAMPLING)
    tokens = sum(len(p) + len(r) for p, r in zip(traj.prompt_ids, traj.response_ids))
    skipped, skipped_weights, trainer = _trained(traj, advantages)
    recomputed, recomputed_weights, _ = _trained(traj, advantages, old_log_probs="recompute")

    assert skipped["perf/update_tokens"] == tokens and skipped["perf/update_forward_tokens"] == 0
    assert recomputed["perf/update_tokens"] == tokens and recomputed["perf/update_forward_tokens"] == tokens
    assert skipped["perf/update_flops"] == 6 * trainer.active_parameters * tokens
    assert recomputed["perf/update_flops"] == 8 * trainer.active_parameters * tokens
    assert skipped["perf/update_tokens_per_s"] > 0 and "perf/update_mfu" not in skipped  # no peak on CPU
    for name in ("actor/pg_loss", "rollout_corr/logprob_abs_diff_mean", "rollout_corr/logprob_abs_diff_max"):
        assert skipped[name] == pytest.approx(recomputed[name], abs=1e-6), name
    assert skipped["rollout_corr/logprob_abs_diff_max"] < 1e-5  # the rollout ran these weights
    for name, weight in recomputed_weights.items():
        torch.testing.assert_close(skipped_weights[name], weight, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("overrides", [{"ppo_epochs": 2}, {"mini_batch_prompts": 1}])
def test_several_optimizer_steps_recompute_the_old_policy(overrides):
    """A second epoch or mini-batch replays after an optimizer step: the old log-probs are recomputed first."""
    traj, advantages = _sampled(SAMPLING)
    tokens = sum(len(p) + len(r) for p, r in zip(traj.prompt_ids, traj.response_ids))
    metrics = _trained(traj, advantages, **overrides)[0]
    assert metrics["perf/update_forward_tokens"] == tokens
    assert metrics["perf/update_tokens"] == tokens * overrides.get("ppo_epochs", 1)
