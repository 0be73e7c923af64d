"""Direct-preference training on final samples: Diffusion-DPO, DiffusionNFT, AWM (DESIGN §1).

Legend: B samples of one RL step, b samples of a micro-batch, P preference pairs, S latent shape.
The clean sample x0 is the latent after the last denoising step, so the rollout's window must end
at the last step (e.g. WindowPolicy("random_start", size=1, start_range=(N - 1, N))). Each sample
gets its own noise and noise level, drawn from a generator keyed by (seed, update, epoch, sample seed):
x_t = (1 - sigma) x0 + sigma noise, flow-matching target = noise - x0. The losses train the
conditional velocity (guidance scale 1, no negative prompt), as the published code does.
DiffusionNFT's old policy is a second LoRA adapter "old", an EMA of "default" with decay
`old_policy_decay(algorithm, update)` applied after every update.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

from diffrl.algorithms.catalog import loss_fn, old_policy_decay
from diffrl.engines.train.policy_loss import rank_rows
from diffrl.engines.train.setup import ADAPTER_NAME, add_lora
from diffrl.engines.train.trainer import PolicyTrainer, _reduce_metrics
from diffrl.engines.trajectories import Trajectories
from diffrl.models.base import SampleShape

OLD_ADAPTER = "old"


def lora_pairs(transformer) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """(default, old) LoRA parameter pairs of the same module."""
    params = dict(transformer.named_parameters())
    return [
        (p, params[n.replace(f".{ADAPTER_NAME}.", f".{OLD_ADAPTER}.")])
        for n, p in params.items()
        if f".{ADAPTER_NAME}." in n and "lora_" in n
    ]


@torch.no_grad()
def ema_update(transformer, decay: float) -> None:
    """old <- decay * old + (1 - decay) * default (decay 0 copies)."""
    for new, old in lora_pairs(transformer):
        old.mul_(decay).add_(new.detach(), alpha=1.0 - decay)


def preference_pairs(advantages: torch.Tensor, group_ids: list[str]) -> list[tuple[int, int]]:
    """(chosen, rejected) per group: the highest- and lowest-advantage samples; groups without a gap are skipped."""
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    pairs = []
    for rows in members.values():
        best = max(rows, key=lambda i: float(advantages[i]))
        worst = min(rows, key=lambda i: float(advantages[i]))
        if float(advantages[best]) > float(advantages[worst]):
            pairs.append((best, worst))
    return pairs


class DirectPreferenceTrainer(PolicyTrainer):
    """Trains direct_preference algorithms (dpo, diffusion_nft, awm) on the rollout's final samples."""

    family = "direct_preference"

    def _extra_setup(self) -> None:
        if self.algorithm.loss != "diffusion_nft_loss":
            return
        if not self.cfg.lora:
            raise ValueError("diffusion_nft needs lora: true (its old policy is a second LoRA adapter)")
        transformer = self.adapter.transformer
        add_lora(
            transformer, self.cfg, self.cfg.lora_targets or tuple(self.adapter.default_lora_targets), name=OLD_ADAPTER
        )
        self._activate(ADAPTER_NAME)
        ema_update(transformer, 0.0)

    def _activate(self, name: str) -> None:
        """Make adapter `name` the one the forward uses; only "default" is ever trainable."""
        transformer = self.adapter.transformer
        transformer.set_adapter(name)
        for pname, p in transformer.named_parameters():  # set_adapter also flips requires_grad: undo that
            p.requires_grad_(f".{ADAPTER_NAME}." in pname and "lora_" in pname)

    @contextlib.contextmanager
    def old_policy(self):
        with torch.no_grad():
            self._activate(OLD_ADAPTER)
            try:
                yield
            finally:
                self._activate(ADAPTER_NAME)

    def _needs_reference(self) -> bool:
        return self.algorithm.loss == "dpo_loss" or self.algorithm.ref_coef > 0

    def _noised(self, x0: torch.Tensor, seeds: torch.Tensor, sigmas_N: torch.Tensor, epoch: int):
        """Per sample (sigma (b,), x_t, target), keyed by (cfg.seed, update, epoch, sample seed): each PPO
        epoch trains every sample at a new noise level, as DiffusionNFT trains several timesteps per sample."""
        sig, x_t, target = [], [], []
        key = self.cfg.seed * 1_000_003 + self.updates * 7_919 + epoch * 104_729
        for i, seed in enumerate(seeds.tolist()):
            gen = torch.Generator().manual_seed((key + int(seed)) % 2**63)
            s = sigmas_N[torch.randint(0, len(sigmas_N) - 1, (1,), generator=gen)].reshape(())
            noise = torch.randn(x0.shape[1:], generator=gen)
            sig.append(s)
            x_t.append((1 - s) * x0[i] + s * noise)
            target.append(noise - x0[i])
        dev = self.device
        return torch.stack(sig).to(dev), torch.stack(x_t).to(dev), torch.stack(target).to(dev)

    def _velocity(self, x_t, sigma, encoding, shape: SampleShape) -> torch.Tensor:
        with self.adapter.attention_context():
            return self.adapter.velocity(x_t, sigma, encoding, None, guidance_scale=1.0, shape=shape)

    def update(self, traj: Trajectories, advantages: torch.Tensor, rollout=None) -> dict[str, float]:
        """One pass of the algorithm's loss over the step's final samples (pairs for DPO); returns metrics."""
        started = time.perf_counter()
        n = self.sampling.num_inference_steps
        if not bool((traj.step_indices[:, -1] == n - 1).all()):
            raise ValueError(
                "direct-preference training needs the final latents: the rollout window must end "
                f"at the last step ({n - 1}); e.g. WindowPolicy('random_start', size=1, "
                f"start_range=({n - 1}, {n}))"
            )
        advantages = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1).cpu()
        engine = rollout if rollout is not None and rollout.adapter is self.adapter else self._replayer
        shape = SampleShape(self.sampling.height, self.sampling.width, self.sampling.num_frames)
        sigmas_N = self.adapter.sigmas(n, shape).float().cpu()
        if self.algorithm.loss == "dpo_loss":
            units = [list(p) for p in preference_pairs(advantages, traj.group_ids)]
        else:
            units = [[i] for i in range(len(traj))]
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        mini = self.cfg.mini_batch_prompts * (1 if self.algorithm.loss == "dpo_loss" else self.group_size)
        for epoch in range(self.cfg.ppo_epochs):
            order = self._order(len(units), epoch)
            for start in range(0, len(units), mini):
                local = rank_rows(order[start : start + mini])
                self.optimizer.zero_grad(set_to_none=True)
                for mb in range(0, len(local), self.cfg.micro_batch_size):
                    chunk = [units[int(u)] for u in local[mb : mb + self.cfg.micro_batch_size]]
                    loss, metrics = self._micro_loss(traj, chunk, advantages, engine, sigmas_N, shape, epoch)
                    (loss * (len(chunk) / len(local))).backward()
                    for k, v in metrics.items():
                        sums[k] += float(v)
                        counts[k] += 1
                self._optimizer_step(sums, counts)
        self.updates += 1
        if self.algorithm.loss == "diffusion_nft_loss":
            ema_update(self.adapter.transformer, old_policy_decay(self.algorithm, self.updates))
        metrics = _reduce_metrics(sums, counts)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        metrics["timing_s/update_actor"] = time.perf_counter() - started
        return metrics

    def _micro_loss(self, traj, chunk: list[list[int]], advantages, engine, sigmas_N, shape, epoch: int):
        """The loss of one micro-batch of units (samples, or (chosen, rejected) pairs for DPO)."""
        a = self.algorithm
        rows = [i for unit in chunk for i in unit]
        sub = traj.select(rows)
        x0 = sub.latents[:, -1]
        # A DPO pair shares its noise and noise level: key both by the chosen sample's seed.
        key_seeds = torch.tensor([traj.seeds[unit[0]] for unit in chunk for _ in unit])
        sigma, x_t, target = self._noised(x0, key_seeds, sigmas_N, epoch)
        encoding = engine.encode(sub.prompts, self.sampling)[0]
        velocity = self._velocity(x_t, sigma, encoding, shape)
        ref_velocity = None
        if self._needs_reference():
            with self.reference_policy():
                ref_velocity = self._velocity(x_t, sigma, encoding, shape)
        adv = advantages[rows].to(self.device)
        if a.loss == "dpo_loss":
            err = ((velocity - target) ** 2).flatten(1).mean(1)
            ref_err = ((ref_velocity - target) ** 2).flatten(1).mean(1)
            return loss_fn(a)(err[0::2], err[1::2], ref_err[0::2], ref_err[1::2], beta=a.beta)
        if a.loss == "awm_loss":
            return loss_fn(a)(
                velocity,
                target,
                sigma,
                adv,
                adv_clip_max=a.adv_clip_max,
                ref_velocity=ref_velocity,
                ref_coef=a.ref_coef,
                weighting=a.awm_weighting,
            )
        with self.old_policy():
            old_velocity = self._velocity(x_t, sigma, encoding, shape)
        return loss_fn(a)(
            velocity,
            old_velocity,
            x_t,
            x0.to(self.device),
            sigma,
            adv,
            adv_clip_max=a.adv_clip_max,
            mix_beta=a.mix_beta,
            ref_velocity=ref_velocity,
            ref_coef=a.ref_coef,
        )
