"""The behaviour copy of an asynchronous run on the tiny SD3: it shares the trainer's frozen tensors, owns its LoRA
tensors (DiffusionNFT's "old" adapter too), samples exactly as the policy at its version while the trainer's weights
move, and a weight sync brings it to the trainer's weights in memory, versioned."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from diffrl.algorithms.catalog import get_algorithm
from diffrl.algorithms.windows import WindowPolicy
from diffrl.configs.rollout import SamplingConfig
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout.engine import RolloutEngine
from diffrl.engines.train.preference import sampling_with_old_adapter
from diffrl.engines.train.sync import behaviour_copy
from diffrl.engines.train.trainer import PolicyTrainer
from diffrl.models.base import load_adapter

SAMPLING = SamplingConfig(num_inference_steps=3, height=32, width=32, noise_level=0.7, batch_size=4)
PROMPTS, GROUPS = ["a red cube", "a red cube", "two cats", "two cats"], ["g0", "g0", "g1", "g1"]


def _sample(engine: RolloutEngine, version: int):
    return engine.generate(PROMPTS, GROUPS, [0, 1, 0, 1], [11, 12, 13, 14], SAMPLING, policy_version=version)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in ((a.latents, b.latents), (a.log_probs, b.log_probs), (a.images, b.images)))


def test_behaviour_copy_samples_as_the_policy_at_its_version(tiny_model):
    adapter = load_adapter(tiny_model("sd3"))
    policy = RolloutEngine(adapter, progress=False)
    trainer = PolicyTrainer(
        adapter,
        get_algorithm("flow_grpo", kl_coef=0.0, clip_ratio=0.2),
        TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2, mini_batch_prompts=2, micro_batch_size=4, seed=1),
        SAMPLING,
        group_size=2,
    )
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    trainer.update(_sample(policy, 0), advantages, policy)  # LoRA B leaves its zero init: the adapter matters

    twin = behaviour_copy(adapter)
    trainer.rollout_copy = twin
    behaviour = RolloutEngine(twin, progress=False)
    mine, theirs = dict(twin.transformer.named_parameters()), dict(adapter.transformer.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, param in theirs.items():  # the base is the same storage; the LoRA tensors are the copy's own
        shared = mine[name].data_ptr() == param.data_ptr()
        assert shared != param.requires_grad, name
        assert not mine[name].requires_grad and torch.equal(mine[name], param)
    assert twin.pipe.vae is adapter.pipe.vae and twin.pipe.text_encoder is adapter.pipe.text_encoder

    at_copy = _sample(behaviour, 0)
    assert _same(at_copy, _sample(policy, 0))  # the copy is the policy at its version, bit for bit
    trainer.update(at_copy, advantages, behaviour)  # the trainer's weights move; the copy's do not
    assert not _same(_sample(policy, 0), at_copy)
    assert _same(_sample(behaviour, 0), at_copy)

    version = trainer.policy_version
    synced = trainer.sync_weights(behaviour)  # in memory: the trained LoRA tensors into the copy
    lora = [p for p in adapter.transformer.parameters() if p.requires_grad]
    assert synced["sync/num_tensors"] == len(lora) and synced["sync/bytes"] == sum(p.numel() * 4 for p in lora)
    assert trainer.policy_version == version + 1 == synced["sync/policy_version"]
    assert _same(_sample(behaviour, 1), _sample(policy, 1))


def test_behaviour_copy_samples_with_its_own_old_adapter_of_its_version(tiny_model):
    """DiffusionNFT samples with its EMA "old" adapter, which the trainer changes in place after each update: the
    behaviour copy owns the old tensors too, samples with them as the trainer's old policy at the copy's version, and a
    sync brings both adapters over."""
    adapter = load_adapter(tiny_model("sd3"))
    policy = RolloutEngine(adapter, progress=False)
    final = SamplingConfig(
        num_inference_steps=3, height=32, width=32, noise_level=0.0, window=WindowPolicy("final", size=1), batch_size=4
    )
    trainer = PolicyTrainer(
        adapter,
        get_algorithm("diffusion_nft", window=WindowPolicy("final", size=1), old_policy_decay_max=0.0),
        TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2, mini_batch_prompts=2, micro_batch_size=4, seed=1),
        final,
        group_size=2,
    )
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])

    def sample(engine: RolloutEngine, old):
        with old():
            return engine.generate(PROMPTS, GROUPS, [0, 1, 0, 1], [11, 12, 13, 14], final, policy_version=0)

    trainer.update(sample(policy, trainer.old_policy), advantages, policy)  # decay 0: old <- the trained default
    twin = behaviour_copy(adapter)
    trainer.rollout_copy = twin
    behaviour = RolloutEngine(twin, progress=False)
    mine, theirs = dict(twin.transformer.named_parameters()), dict(adapter.transformer.named_parameters())
    old = [name for name in theirs if ".old." in name]
    assert old and all(not theirs[n].requires_grad and mine[n].data_ptr() != theirs[n].data_ptr() for n in old)

    at_copy = sample(behaviour, lambda: sampling_with_old_adapter(twin))
    assert _same(at_copy, sample(policy, trainer.old_policy))  # the trainer's old policy, bit for bit
    assert all(not p.requires_grad for p in twin.transformer.parameters())  # the copy stays frozen
    trainer.update(at_copy, advantages, behaviour)  # the trainer's EMA moves its old adapter; the copy's stays
    assert not _same(sample(policy, trainer.old_policy), at_copy)
    assert _same(sample(behaviour, lambda: sampling_with_old_adapter(twin)), at_copy)

    synced = trainer.sync_weights(behaviour)  # both adapters' LoRA tensors
    assert synced["sync/num_tensors"] == sum("lora_" in n for n in theirs)
    assert _same(sample(behaviour, lambda: sampling_with_old_adapter(twin)), sample(policy, trainer.old_policy))


def test_a_replicas_behaviour_copy_shares_the_sharded_trainers_frozen_tensors(tiny_model, tmp_path):
    """Engine replicas' trainers are FSDP2-wrapped (LoRA: HSDP over a shard group of one, here a process group of one):
    the copy is framed before the wrap and bound after it to the DTensors' local tensors, the same storage; it samples
    as the wrapped policy and a weight sync (DTensor.full_tensor) brings it to the trainer's LoRA tensors."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from diffrl.engines.train.setup import prepare_denoiser, shard
    from diffrl.engines.train.sync import behaviour_frame, bind_frozen, send_weights

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        adapter = load_adapter(tiny_model("sd3"))
        cfg = TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2, mini_batch_prompts=2, micro_batch_size=4, seed=1)
        prepare_denoiser(adapter, cfg, torch.device("cpu"))
        frame = behaviour_frame(adapter)
        frozen = [p for p in adapter.transformer.parameters() if not p.requires_grad]
        assert sum(p.is_meta for p in frame.transformer.parameters()) == len(frozen) > 0  # placeholders: no memory
        shard(adapter, cfg, torch.device("cpu"), replicate=True)
        twin = bind_frozen(frame, adapter)
        theirs = dict(adapter.transformer.named_parameters())
        mine = dict(twin.transformer.named_parameters())
        assert mine.keys() == theirs.keys() and all(isinstance(p, DTensor) for p in theirs.values())
        for name, param in theirs.items():
            local = param.to_local()
            assert not mine[name].is_meta and not isinstance(mine[name], DTensor), name
            assert (mine[name].data_ptr() == local.data_ptr()) != param.requires_grad, name  # frozen: shared
        with torch.no_grad():  # the trainer's LoRA moves; the copy's does not until the sync
            for param in theirs.values():
                if param.requires_grad:
                    param.to_local().add_(0.05)
        policy, behaviour = RolloutEngine(adapter, progress=False), RolloutEngine(twin, progress=False)
        assert not _same(_sample(behaviour, 0), _sample(policy, 0))
        num_tensors, _ = send_weights(SimpleNamespace(cfg=cfg, adapter=adapter), twin)
        assert num_tensors == sum(p.requires_grad for p in theirs.values()) > 0
        assert _same(_sample(behaviour, 1), _sample(policy, 1))
    finally:
        dist.destroy_process_group()
