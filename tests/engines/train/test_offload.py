"""HostOffload (diffrl/engines/train/offload.py): the trainer's weights and optimizer state leave for the host and come
back between two updates, and the second update is bit-identical to one with no round trip in between (LoRA and full
fine-tuning: the moments of AdamW travel too). On this CPU machine "host" and device are the same memory, so what is
checked is that every tensor is replaced by a copy and restored with its values, and the objects the optimizer holds
stay the same."""

from __future__ import annotations

import pytest
import torch

from diffrl.algorithms.catalog import get_algorithm
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout.tokens import TokenSampling, TransformersTokenEngine
from diffrl.engines.train.offload import HostOffload
from diffrl.engines.train.tokens import TokenTrainer
from diffrl.models.causal_lm.policy import CausalLMPolicy
from diffrl.models.causal_lm.tiny_thinker import tiny_thinker

SAMPLING = TokenSampling(max_new_tokens=4, temperature=1.0, batch_size=8)


def _two_updates(lora: bool, offload_between: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    policy = CausalLMPolicy(*tiny_thinker(0))
    cfg = TrainConfig(lora=lora, lora_rank=4, lora_alpha=8, lr=1e-2, mini_batch_prompts=1, micro_batch_size=4)
    trainer = TokenTrainer(policy, get_algorithm("grpo"), cfg, SAMPLING, group_size=4)
    rollout = TransformersTokenEngine(policy)
    traj = rollout.generate(["red circle. what shape?"] * 4, ["a"] * 4, [0, 1, 2, 3], [5] * 4, SAMPLING)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    trainer.update(traj, advantages, rollout)
    if offload_between:
        offload = HostOffload(policy.model, trainer.optimizer)
        params = list(policy.model.parameters())
        pointers = [p.data_ptr() for p in params]
        moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
        assert offload.to_host() >= 0 and offload.on_host and offload.bytes_moved > 0
        assert all(p.data_ptr() != ptr for p, ptr in zip(params, pointers))  # every weight is a copy now
        assert all(s["exp_avg"] is not m for s, m in zip(trainer.optimizer.state.values(), moments))
        assert offload.to_device() >= 0 and not offload.on_host
        assert list(policy.model.parameters()) == params  # the same Parameter objects
        assert trainer.optimizer.param_groups[0]["params"][0] is trainer.params[0]
    trainer.update(traj, advantages, rollout)
    return {k: v.detach().clone() for k, v in policy.model.state_dict().items()}


@pytest.mark.parametrize("lora", [True, False])
def test_a_round_trip_to_the_host_leaves_training_unchanged(lora):
    plain, offloaded = _two_updates(lora, False), _two_updates(lora, True)
    assert plain.keys() == offloaded.keys()
    for key in plain:
        assert torch.equal(plain[key], offloaded[key]), key
