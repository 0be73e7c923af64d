"""The optional vLLM-Omni diffusion rollout backend, client side at its seams. NOT RUN: vllm-omni has no CPU platform
(its engine start fails in `set_device` on a CPU machine) and has not been started on the GPU machine by diffrl yet;
docs/models.md says what ran. What is here is what diffrl owns of that backend, tested on the CPU
(tests/engines/rollout/test_vllm_omni_seams.py): the request it sends, how the answer becomes diffrl's Trajectories,
and the SDE step its rollout pipeline takes, which is diffrl's own (algorithms/sde.py).

How vLLM-Omni serves an RL rollout (facts from its public code and VeRL-Omni's, which drives it):
- A diffusion model runs as a pipeline in vLLM-Omni's diffusion workers; an RL rollout uses a custom pipeline class,
  named by dotted path in `custom_pipeline_args={"pipeline_class": ...}` and built by
  `CustomPipelineWorkerExtension.re_init_pipeline` (vllm_omni/diffusion/worker/diffusion_worker.py) from
  `od_config` alone, on the CPU, then moved to the device. VeRL-Omni's `QwenImagePipelineWithLogProb`
  (verl_omni/pipelines/qwen_image_flow_grpo/vllm_omni_rollout_adapter.py) subclasses vLLM-Omni's QwenImagePipeline and
  swaps the scheduler for `FlowMatchSDEDiscreteScheduler` (verl_omni/pipelines/schedulers/flow_match_sde.py).
- Request: the prompt is a dict with `prompt_token_ids` / `prompt_mask` (and `negative_prompt_ids` /
  `negative_prompt_mask`); the sampling parameters (`OmniDiffusionSamplingParams`, vllm_omni/inputs/data.py) carry
  height, width, num_inference_steps, seed, guidance_scale, true_cfg_scale, num_outputs_per_prompt, and
  `extra_args` with the algorithm's knobs: noise_level, sde_window_size, sde_window_range, sde_type, logprobs.
- The window: the pipeline draws its start once per request batch, uniformly in
  [sde_window_range[0], sde_window_range[1] - sde_window_size]; steps before and after it run with noise level 0.
  diffrl picks the window itself (algorithms/windows.py) and pins it by sending range (start, start + size).
- Response: `DiffusionOutput.custom_output` with `all_latents` (B, W+1, ...) fp32 (the latent entering the window,
  then each step's output), `all_log_probs` (B, W), `all_timesteps` (B, W) (= sigma * 1000), the prompt embeddings,
  and `output` (the decoded images).
- The step: timesteps are sigma * 1000 over descending sigmas; step i goes sigmas[i] -> sigmas[i + 1], and the
  "sde" type's 1 - sigma denominator uses sigmas[1] where sigma == 1 -- exactly diffrl's `sde_step` with
  `sigma_max=sigmas[1]` (tests check the two agree on every sde_type vLLM-Omni has: "sde", "cps").
- Weights: LoRA through `DiffusionLoRAManager` (`add_lora(LoRARequest)`, PEFT folders, vllm_omni/diffusion/lora/
  manager.py) -- the same PEFT folder diffrl writes for vLLM (engines/rollout/vllm_weights.py); full weights through
  the pipeline's `load_weights((name, tensor) pairs)`; `sleep(level)` / `wake_up(tags)` free the GPU for the update.

So diffrl's pipeline for vLLM-Omni is a thin class whose denoising loop calls `omni_sde_step` below (diffrl's math),
and this module maps to and from it. What is missing to run it: the vllm-omni venv on a GPU machine (vllm-omni 0.24.0
pins diffusers 0.38.0 and accelerate 1.12.0; openai-whisper must be built from its sdist) and the worker-side pipeline
class; benchmarks/vllm_omni_rollout.py is where the GPU attempt goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrl.algorithms.sde import SDEStep, sde_step

OMNI_SDE_TYPES = ("sde", "cps")  # FlowMatchSDEDiscreteScheduler's; diffrl's "dance_sde" has no vLLM-Omni twin
TIMESTEP_SCALE = 1000.0  # vLLM-Omni / diffusers timesteps are sigma * 1000


@dataclass(frozen=True)
class OmniChunk:
    """One request's worth of samples: all share a prompt and a window (vLLM-Omni draws one window per request).

    prompt_ids / negative_prompt_ids: the tokenized prompt (no padding). seeds: one per sample.
    window_start / window_size: the stochastic steps [start, start + size) of the num_inference_steps schedule.
    """

    prompt_ids: list[int]
    negative_prompt_ids: list[int] | None
    seeds: list[int]
    window_start: int
    window_size: int


def omni_request(
    chunk: OmniChunk,
    *,
    height: int,
    width: int,
    num_inference_steps: int,
    guidance_scale: float,
    noise_level: float,
    sde_type: str,
) -> dict:
    """The JSON-able request for one chunk: {"prompt": {...}, "sampling_params": {...}} in vLLM-Omni's names.

    guidance_scale > 1 with a negative prompt is true CFG (`true_cfg_scale`, Qwen-Image's convention)."""
    if sde_type not in OMNI_SDE_TYPES:
        raise ValueError(f"vLLM-Omni's SDE scheduler has sde_type {list(OMNI_SDE_TYPES)}; got {sde_type!r}")
    end = chunk.window_start + chunk.window_size
    if chunk.window_start < 0 or chunk.window_size < 1 or end > num_inference_steps:
        raise ValueError(f"window [{chunk.window_start}, {end}) does not fit {num_inference_steps} steps")
    if len(set(chunk.seeds)) != 1 and len(chunk.seeds) > 1:
        # vLLM-Omni seeds a request's generator once: n outputs of one request come from one seed in turn
        raise ValueError("one vLLM-Omni request takes one seed; send samples with their own seeds as own requests")
    prompt = {"prompt_token_ids": list(chunk.prompt_ids), "prompt_mask": [1] * len(chunk.prompt_ids)}
    if chunk.negative_prompt_ids is not None:
        prompt["negative_prompt_ids"] = list(chunk.negative_prompt_ids)
        prompt["negative_prompt_mask"] = [1] * len(chunk.negative_prompt_ids)
    params = {
        "height": height,
        "width": width,
        "num_inference_steps": num_inference_steps,
        "seed": int(chunk.seeds[0]),
        "num_outputs_per_prompt": len(chunk.seeds),
        "true_cfg_scale": guidance_scale,
        "extra_args": {
            "noise_level": noise_level,
            "sde_type": sde_type,
            "sde_window_size": chunk.window_size,
            # the start is drawn from [range[0], range[1] - size]: a range of exactly `size` pins it
            "sde_window_range": [chunk.window_start, end],
            "logprobs": True,
        },
    }
    return {"prompt": prompt, "sampling_params": params}


@dataclass
class OmniRollout:
    """What diffrl keeps of a vLLM-Omni answer, in Trajectories' layout (engines/trajectories.py)."""

    latents: torch.Tensor  # (B, W + 1, *S) fp32
    log_probs: torch.Tensor  # (B, W) fp32
    sigmas: torch.Tensor  # (B, W)
    sigmas_prev: torch.Tensor  # (B, W)
    window_starts: torch.Tensor  # (B,) int64
    images: torch.Tensor | None  # (B, H, W, 3) uint8 when decoded


def rollout_from_omni(custom_output: dict, schedule_sigmas: torch.Tensor, images=None) -> OmniRollout:
    """Map `DiffusionOutput.custom_output` to diffrl's layout. schedule_sigmas: (N + 1,) the schedule diffrl's adapter
    computes for this resolution and step count (descending, ending at 0); the answer's timesteps must be a run of it,
    else the two sides disagree on the schedule (ValueError, never a silent misalignment)."""
    latents = custom_output["all_latents"]
    log_probs = custom_output.get("all_log_probs")
    timesteps = custom_output["all_timesteps"]
    if log_probs is None:
        raise ValueError("vLLM-Omni answered without all_log_probs: send extra_args.logprobs=true")
    latents, log_probs = torch.as_tensor(latents), torch.as_tensor(log_probs)
    sigmas = torch.as_tensor(timesteps, dtype=torch.float64) / TIMESTEP_SCALE
    b, w = log_probs.shape
    if latents.shape[:2] != (b, w + 1) or sigmas.shape != (b, w):
        raise ValueError(
            f"all_latents {tuple(latents.shape)}, all_log_probs {(b, w)}, all_timesteps "
            f"{tuple(sigmas.shape)}: expected (B, W+1, ...), (B, W), (B, W)"
        )
    schedule = torch.as_tensor(schedule_sigmas, dtype=torch.float64)
    starts = torch.empty(b, dtype=torch.long)
    for i in range(b):
        hits = torch.nonzero(torch.isclose(schedule[:-1], sigmas[i, 0], rtol=0, atol=1e-6)).flatten()
        if len(hits) != 1 or not torch.allclose(schedule[hits[0] : hits[0] + w], sigmas[i], rtol=0, atol=1e-6):
            raise ValueError(f"sample {i}: vLLM-Omni's timesteps {sigmas[i].tolist()} are not a run of the schedule")
        starts[i] = hits[0]
    steps = starts[:, None] + torch.arange(w)[None, :]
    return OmniRollout(
        latents=latents.float(),
        log_probs=log_probs.float(),
        sigmas=schedule[steps].float(),
        sigmas_prev=schedule[steps + 1].float(),
        window_starts=starts,
        images=None if images is None else torch.as_tensor(images),
    )


def omni_sde_step(
    sample: torch.Tensor,
    velocity: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: int,
    *,
    noise_level: float,
    sde_type: str = "sde",
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SDEStep:
    """Step `step_index` of the schedule `sigmas` (N + 1,) as vLLM-Omni's SDE scheduler indexes it (sigma =
    sigmas[i], sigma_prev = sigmas[i + 1], sigma_max = sigmas[1]), computed by diffrl's sde_step: the step diffrl's
    vLLM-Omni pipeline takes, so its log-probs are the trainer's by construction."""
    if sde_type not in OMNI_SDE_TYPES:
        raise ValueError(f"sde_type must be one of {list(OMNI_SDE_TYPES)}; got {sde_type!r}")
    batch = sample.shape[0]
    sigma = sigmas[step_index].expand(batch)
    sigma_prev = sigmas[step_index + 1].expand(batch)
    return sde_step(
        sample,
        velocity,
        sigma,
        sigma_prev,
        noise_level=noise_level,
        sde_type=sde_type,
        prev_sample=prev_sample,
        generator=generator,
        sigma_max=float(sigmas[1]),
    )


def lora_request(version: int, folder: str) -> dict:
    """vLLM's LoRARequest fields for policy `version` (vLLM-Omni's DiffusionLoRAManager takes the same request):
    a name and a positive integer id per version, the PEFT folder's path."""
    if version < 0:
        raise ValueError(f"policy version must be >= 0; got {version}")
    return {"lora_name": f"policy-v{version}", "lora_int_id": version + 1, "lora_path": folder}
