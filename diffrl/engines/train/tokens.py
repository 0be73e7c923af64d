"""The trainer of an autoregressive policy: updates a causal LM / VLM with any token algorithm by asking it, as
PolicyTrainer does for the diffusion family (`algorithm.needs` says what to prepare, `algorithm.loss(TokenBatch)`
computes a micro-batch's loss; no algorithm is named here).

The shared helpers build and save it: LoRA or full fine-tuning, optimizer and LR schedule (engines/train/setup.py),
checkpoints (engines/train/checkpoint.py), the finite-weights check. The policy (diffrl/models/causal_lm/policy.py)
answers what those helpers ask of an adapter.

Legend: B samples of a step, M = mini_batch_prompts x group_size samples per optimizer step (mini_batch_prompts pairs
for pair algorithms), b samples of a micro-batch, T response tokens (right-padded).

Forward passes: each micro-batch's replay (and the reference's log-probs, and the old policy's recompute) runs its
sequences packed into one row without padding where the policy packs them (text-only prompts of Qwen3, Qwen3-MoE or
the Qwen3-Omni Thinker: diffrl/models/causal_lm/packing.py), else padded to the micro-batch's longest; the log-probs
and gradients are the same either way.

Old policy: the ratio's old log-probs are the rollout's when the rollout ran this trainer's adapter at the current
policy version (TrainConfig.old_log_probs "auto", same numerics). Otherwise they are the current weights' before the
step's first optimizer step. When the step is a single pass -- one PPO epoch and one mini-batch, so no optimizer step
comes before any micro-batch's replay -- and the forward is deterministic (no dropout), those are exactly the replay's
own log-probs: the replay's detached log-probs are the old policy's (the ratio is 1, as a recompute would make it) and
no recompute runs; the rollout/trainer gap (rollout_corr/*) and rollout_correction's weights come from the replay then.
Otherwise (several epochs or mini-batches, dropout, or old_log_probs "recompute") a no-grad pass recomputes them first.

Loss scaling: each micro-batch's loss is the algorithm's aggregate over its b samples; it is multiplied by b / M
before its backward, so one optimizer step sees the mean over its micro-batches weighted by their sizes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections import defaultdict

import torch

from diffrl.algorithms.base import Algorithm
from diffrl.algorithms.batches import TokenBatch
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout.engine import to_device
from diffrl.engines.rollout.tokens import TokenSampling
from diffrl.engines.token_trajectories import TokenTrajectories
from diffrl.engines.train.base import TrainerBase
from diffrl.engines.train.policy_loss import correction_stats, correction_weights, lora_disabled
from diffrl.engines.train.preference import training_units
from diffrl.engines.train.setup import build_optimizer, build_scheduler, check_offload, prepare_denoiser, world
from diffrl.engines.train.sync import send_weights
from diffrl.engines.train.throughput import add_update_rates
from diffrl.engines.train.trainer import _accumulate, _add_gap, _add_values, _reduce_metrics
from diffrl.models.causal_lm.flops import active_parameters
from diffrl.models.causal_lm.policy import CausalLMPolicy


class TokenTrainer(TrainerBase):
    """Owns the trainable causal LM (LoRA or full), its optimizer/schedule, checkpoints and weight sync; trains every
    algorithm whose needs.data is "tokens". The policy's module is trained in place, so an in-process rollout on the
    same policy samples with the trained weights without a copy."""

    def __init__(
        self,
        policy: CausalLMPolicy,
        algorithm: Algorithm,
        cfg: TrainConfig,
        sampling: TokenSampling,
        *,
        group_size: int,
        device: str | torch.device | None = None,
    ):
        if algorithm.needs.data != "tokens":
            raise ValueError(
                f"algorithm {algorithm.name!r} trains on {algorithm.needs.data}; TokenTrainer trains an autoregressive "
                "model on tokens (diffusion algorithms need a diffusion model: PolicyTrainer)"
            )
        self.rank, self.world_size = world()
        if self.world_size > 1:
            raise ValueError("TokenTrainer trains in one process for now (cluster.gpus: 1)")
        check_offload(cfg)
        self.adapter, self.algorithm, self.cfg, self.sampling = policy, algorithm, cfg, sampling
        self.group_size = group_size
        self.device = torch.device(device) if device is not None else policy.device
        # transformers names its checkpointing switch differently from diffusers: set it here, not in the helper
        prepare_denoiser(policy, dataclasses.replace(cfg, gradient_checkpointing=False), self.device)
        if cfg.gradient_checkpointing:
            policy.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.reference = None
        if algorithm.needs.reference and not cfg.lora:  # full fine-tuning: a frozen copy of the initial weights
            self.reference = copy.deepcopy(policy.model).requires_grad_(False).eval()
            if cfg.offload_reference:
                self.reference.to("cpu")
        self.params = [p for p in policy.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg)
        init_optimizer_state(self.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.optimizer_steps = 0
        self.updates = 0
        self._version = 0
        self._stepped_since_sync = False
        self.last_exported: dict[str, torch.Tensor] = {}
        self.rollout_copy: CausalLMPolicy | None = None  # an asynchronous run's behaviour copy (sync_weights)
        self.active_parameters = _active_parameters(policy.model)
        self._tokens = {"trained": 0, "forward": 0}  # the current update's tokens with and without a backward

    @contextlib.contextmanager
    def reference_policy(self):
        """Within it, the policy runs the reference weights (no autograd): LoRA off, or the frozen copy."""
        with torch.no_grad():
            if self.cfg.lora:
                with lora_disabled(self.adapter.model):
                    yield
                return
            trained, self.adapter.model = self.adapter.model, self.reference.to(self.device)
            try:
                yield
            finally:
                self.adapter.model = trained
                if self.cfg.offload_reference:
                    self.reference.to("cpu")

    # ---- the update -------------------------------------------------------------------------------------
    def update(self, traj: TokenTrajectories, advantages: torch.Tensor, rollout=None) -> dict[str, float]:
        """One RL step's update of the policy on `traj` (the rows the step core picked) and their advantages (B,);
        returns actor/*, rollout_corr/*, timing and perf/update_* metrics. `rollout` is the engine that sampled `traj`.

        perf/update_tokens: the prompt and response tokens of every forward+backward pass (padding not counted);
        perf/update_forward_tokens: those of the passes without a backward (the old policy's recompute, the
        reference); perf/update_flops: 6 x active parameters x the former + 2 x active parameters x the latter
        (diffrl/models/causal_lm/flops.py; gradient checkpointing's recompute is not counted, as MFU counts model
        FLOPs); perf/update_tokens_per_s and perf/update_mfu per second of the update (engines/train/throughput.py)."""
        started = time.perf_counter()
        self._tokens = {"trained": 0, "forward": 0}
        advantages = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1).cpu()
        if advantages.shape[0] != len(traj):
            raise ValueError(f"advantages has {advantages.shape[0]} entries but traj has {len(traj)} samples")
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        if len(traj):
            self._train(traj, advantages, rollout, sums, counts)
        self.updates += 1
        metrics = _reduce_metrics(sums, counts)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        metrics["timing_s/update_actor"] = time.perf_counter() - started
        metrics.update(self.token_counts())
        return add_update_rates(metrics, metrics["timing_s/update_actor"], self.device)

    def token_counts(self) -> dict[str, float]:
        """perf/update_tokens, perf/update_forward_tokens and (the active parameters known) perf/update_flops of the
        last update (see `update`)."""
        trained, forward = self._tokens["trained"], self._tokens["forward"]
        counts = {"perf/update_tokens": float(trained), "perf/update_forward_tokens": float(forward)}
        if self.active_parameters is not None:
            counts["perf/update_flops"] = float(self.active_parameters * (6 * trained + 2 * forward))
        return counts

    def _train(self, traj: TokenTrajectories, advantages, rollout, sums, counts) -> None:
        """Every PPO epoch and mini-batch of the step's samples (or pairs), one optimizer step per mini-batch."""
        response_ids, rollout_log_probs, mask = traj.padded()
        same_numerics = (
            rollout is not None
            and getattr(rollout, "adapter", None) is self.adapter
            and traj.policy_version == self._version
            and not self._stepped_since_sync
        )
        pairs = self.algorithm.needs.pairs
        units = training_units(advantages, traj.group_ids, pairs)
        mini = self.cfg.mini_batch_prompts * (1 if pairs else self.group_size)
        # one epoch, one mini-batch: every replay runs at the weights the old policy had (module docstring)
        single_pass = self.cfg.ppo_epochs == 1 and len(units) <= mini and not dropout_active(self.adapter.model)
        old = rollout_log_probs
        if self.algorithm.needs.old_log_probs and self.cfg.recompute_old_log_probs(same_numerics, single_pass):
            old = self._forward_all(traj, response_ids)
            _add_gap(sums, counts, old, rollout_log_probs, mask.bool())
            _add_values(sums, counts, correction_stats(old, rollout_log_probs, mask, self.cfg))
        elif self.algorithm.needs.old_log_probs and self.cfg.recompute_old_log_probs(same_numerics):
            old = None  # the replay's own log-probs, detached, are the old policy's
        # a single pass's old log-probs, gathered from its replays for the correction's ratio statistics
        replayed = torch.zeros(response_ids.shape) if old is None and self.cfg.rollout_correction != "off" else None
        for epoch in range(self.cfg.ppo_epochs):
            order = self._order(len(units), epoch)
            for start in range(0, len(units), mini):
                rows = [i for u in order[start : start + mini].tolist() for i in units[u]]
                measure_gap = old is None or (old is rollout_log_probs and epoch == 0 and start == 0)
                self._mini_batch(
                    traj,
                    rows,
                    (response_ids, rollout_log_probs, mask, old, replayed),
                    advantages,
                    sums,
                    counts,
                    measure_gap,
                )
        if replayed is not None:
            _add_values(sums, counts, correction_stats(replayed, rollout_log_probs, mask, self.cfg))

    def _order(self, num_units: int, epoch: int) -> torch.Tensor:
        """Unit order of one PPO epoch: a permutation keyed by (seed, update, epoch)."""
        if not self.cfg.shuffle:
            return torch.arange(num_units)
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.updates * 1009 + epoch)
        return torch.randperm(num_units, generator=gen)

    def _mini_batch(self, traj, rows: list[int], tensors, advantages, sums, counts, measure_gap: bool) -> None:
        """Forward/backward every micro-batch of one mini-batch (pairs stay whole), then one optimizer step."""
        response_ids, rollout_log_probs, mask, old, replayed = tensors
        step = self.cfg.micro_batch_size + (self.cfg.micro_batch_size % 2 if self.algorithm.needs.pairs else 0)
        self.optimizer.zero_grad(set_to_none=True)
        for mb in range(0, len(rows), step):
            idx = rows[mb : mb + step]
            width = int(mask[idx].sum(dim=1).max().clamp_min(1))
            ids, token_mask = response_ids[idx, :width], mask[idx, :width]
            log_probs, entropy = self._replay(traj.select(idx), ids, entropy=True)
            ref = None
            if self.algorithm.needs.reference:
                with self.reference_policy():
                    ref = self._replay(traj.select(idx), ids)[0]
            if old is None:  # a single pass: the old policy is the current one (module docstring)
                old_log_probs = log_probs.detach()
                weights = correction_weights(
                    old_log_probs, to_device(rollout_log_probs[idx, :width], self.device), self.cfg
                )
            else:
                old_log_probs = to_device(old[idx, :width], self.device)
                weights = correction_weights(old[idx, :width], rollout_log_probs[idx, :width], self.cfg)
            device_mask = to_device(token_mask, self.device)
            batch = TokenBatch(  # host -> device copies queued behind the forward, not waited for (to_device)
                log_probs=log_probs,
                old_log_probs=old_log_probs,
                mask=device_mask,
                advantages=to_device(advantages[idx], self.device),
                ref_log_probs=ref,
                weights=None if weights is None else to_device(weights, self.device),
            )
            loss, step_metrics = self.algorithm.loss(batch)
            (loss * (len(idx) / len(rows))).backward()
            entropy_mean = (entropy.detach() * device_mask).sum() / device_mask.sum().clamp_min(1)
            # summed on the device and read once at the update's end (a float() here waited for this pass's backward)
            _accumulate(sums, counts, {**step_metrics, "actor/entropy": entropy_mean})
            if measure_gap:
                replay_log_probs = log_probs.detach().float().cpu()
                _add_gap(sums, counts, replay_log_probs, rollout_log_probs[idx, :width], token_mask.bool())
                if replayed is not None:  # a single pass: these are the old policy's log-probs
                    replayed[idx, :width] = replay_log_probs
        self._optimizer_step(sums, counts)

    def _replay(self, sub: TokenTrajectories, response_ids: torch.Tensor, *, entropy: bool = False):
        """(log-probs (b, W), entropy or None) of `sub`'s responses (response_ids (b, W), right-padded) under the
        policy's current weights: one packed row where the policy packs these prompts, else padded. Counts the
        pass's tokens (with a backward when grad is on)."""
        tokens = sum(len(p) + len(r) for p, r in zip(sub.prompt_ids, sub.response_ids))
        self._tokens["trained" if torch.is_grad_enabled() else "forward"] += tokens
        temperature = self.sampling.temperature
        if self.adapter.packs(sub.image_paths, sub.audio_paths):
            log_probs, entropies = self.adapter.replay_packed(
                sub.prompt_ids, sub.response_ids, temperature=temperature, entropy=entropy
            )
            pad = response_ids.shape[1] - log_probs.shape[1]  # the packed width is the longest response of `sub`
            if pad:
                log_probs = torch.nn.functional.pad(log_probs, (0, pad))
                entropies = None if entropies is None else torch.nn.functional.pad(entropies, (0, pad))
            return log_probs, entropies
        inputs = self.adapter.inputs_from_ids(sub.prompt_ids, sub.image_paths, sub.audio_paths)
        return self.adapter.replay(inputs, response_ids, temperature=temperature, entropy=entropy)

    @torch.no_grad()
    def _forward_all(self, traj: TokenTrajectories, response_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) log-probs of every sample under the current weights, before any optimizer step (the old policy)."""
        out = torch.zeros(response_ids.shape, dtype=torch.float32)
        size = self.cfg.micro_batch_size
        for start in range(0, len(traj), size):
            idx = list(range(start, min(start + size, len(traj))))
            out[idx] = self._replay(traj.select(idx), response_ids[idx])[0].float().cpu()
        return out * traj.padded()[2]  # padding positions hold 0, as the rollout's padded log-probs do

    def sync_weights(self, rollout) -> dict[str, float]:
        """The in-process rollout shares this module: the policy version moves (and the rollout learns it); an
        asynchronous run's behaviour copy (`rollout_copy`, diffrl/engines/train/sync.py) takes the trained LoRA
        tensors in memory first; a rollout server takes the weights of the new version. timing_s/sync_weights leaves
        out the server's wake the load waited for (`last_wake_s`, reported by the server's engine as timing_s/wake
        and timing_s/offload)."""
        started = time.perf_counter()
        sent = {}
        if rollout is not None and self.rollout_copy is not None and rollout.adapter is self.rollout_copy:
            num_tensors, num_bytes = send_weights(self, rollout.adapter)
            sent = {"sync/num_tensors": float(num_tensors), "sync/bytes": float(num_bytes)}
        self.mark_synced()
        if rollout is not None:
            rollout.update_weights(self._version)
        seconds = time.perf_counter() - started - float(getattr(rollout, "last_wake_s", 0.0))
        return {"timing_s/sync_weights": seconds, **sent, "sync/policy_version": float(self._version)}


def dropout_active(model: torch.nn.Module) -> bool:
    """Whether a training forward of `model` draws dropout (a dropout module with p > 0, or attention dropout in its
    text config): then two forwards at the same weights differ, and the replay is no stand-in for the old policy."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return bool(getattr(text, "attention_dropout", 0.0) or 0.0)


def _active_parameters(model: torch.nn.Module) -> int | None:
    """The model's active parameters per token (diffrl/models/causal_lm/flops.py), None for a config without the
    decoder fields it reads (then the update reports no FLOPs)."""
    try:
        return active_parameters(model.config)
    except AttributeError:
        return None


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Every parameter's optimizer state now, as AdamW makes it at a parameter's first update (zero moments, step
    0), instead of at that update: a checkpoint then holds the state of every trained parameter, also of those no
    update reached (a text-only run never reaches the Thinker's vision and audio towers), and a resumed optimizer
    loads into the same keys (torch's DCP otherwise finds the towers' state missing from the checkpoint)."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # the step below must not move a weight (AdamW's decay is lr x weight_decay too)
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        state["step"].zero_()  # the zero-gradient step above does not count
