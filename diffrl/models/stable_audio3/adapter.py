"""Stable Audio 3 text-to-audio as a diffrl model adapter (audio only: no frames).

Mirrors `diffusers.pipelines.stable_audio_3.pipeline_stable_audio_3.StableAudio3Pipeline` (diffusers 0.42.1): T5Gemma
prompt embeddings padded (on the left, Gemma's side) to min(tokenizer length, 256) tokens with their attention mask;
the duration in seconds embedded by `StableAudio3DurationEmbedder` and used twice, as the DiT's global (AdaLN)
condition and as one more cross-attention token after the text; latents (B, C, T') of C = the VAE's latent_dim and
T' = ceil(duration x sample rate / the VAE's downsampling ratio), drawn as one standard normal tensor; the log-SNR
sigma schedule (`logsnr_sigma_schedule`, logsnr_min -6.2, logsnr_max 2.0) through the folder's
FlowMatchEulerDiscreteScheduler, timestep = sigma x num_train_timesteps (1: the DiT takes timesteps in [0, 1]); CFG
`uncond + g * (cond - uncond)` on one batched forward (negative first, as upstream) when guidance_scale > 1; the
SAME autoencoder's decode cut to int(duration x sample rate) samples and clamped to [-1, 1].

Legend: B batch, L text tokens, D text hidden size, C latent channels, T' latent frames, T audio samples.

Deviations from the upstream pipeline (documented, by design):
- The distilled checkpoint's scheduler has `stochastic_sampling=True`: upstream then re-noises each step's x0
  prediction with fresh noise ("ping-pong" sampling), which is not an SDE with a density. diffrl integrates the same
  sigma schedule with Euler (noise level 0) or SDE steps (Flow-GRPO's), so outputs equal upstream's where the folder's
  scheduler has `stochastic_sampling=False` (the non-distilled base checkpoint, and the tiny folder the parity test
  uses).
- `max_sequence_length` (upstream has none) replaces the tokenizer length when given.
- `silence_padding_duration` is 0 (upstream's default); a duration that leaves no latent frame is a ValueError.
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
from diffusers import StableAudio3DiTModel, StableAudio3Pipeline
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.pipelines.stable_audio_3.pipeline_stable_audio_3 import logsnr_sigma_schedule
from diffusers.utils.torch_utils import randn_tensor

from diffrl.models.base import (
    DiffusersLoraWriter,
    Encoding,
    ModelAdapter,
    SampleShape,
    load_pipeline,
    register_adapter,
)

LOGSNR_MIN, LOGSNR_MAX = -6.2, 2.0  # StableAudio3Pipeline.__call__ defaults
MAX_TEXT_TOKENS = 256  # the pipeline's cap on the tokenizer length (the reference checkpoint's max_length)


class StableAudio3LoraDiT(StableAudio3DiTModel, PeftAdapterMixin):
    """StableAudio3DiTModel with diffusers' LoRA methods (add_adapter, set_adapter, disable_adapters, ...), which
    diffusers 0.42.1 leaves out of this class; the module, its weights and forward are StableAudio3DiTModel's."""


class StableAudio3LoraPipeline(DiffusersLoraWriter, StableAudio3Pipeline):
    """StableAudio3Pipeline that can write a LoRA of its transformer (diffusers 0.42.1 gives it no LoRA loader): the
    same components and __call__; loaded from the same folders."""


@register_adapter
class StableAudio3Adapter(ModelAdapter):
    """Stable Audio 3 (`StableAudio3Pipeline` folders): stereo waveforms from text, `duration` seconds long."""

    arch = "stable_audio3"
    pipeline_classes = ("StableAudio3Pipeline",)
    has_audio = True
    visual = False
    # Self-attention, cross-attention and SwiGLU projections of every StableAudio3DiTBlock.
    default_lora_targets = ("to_qkv", "to_q", "to_kv", "to_out", "ff.proj_in", "ff.proj_out")
    default_guidance_scale = 1.0  # StableAudio3Pipeline.__call__ default (the distilled model has CFG baked in)
    default_max_sequence_length = MAX_TEXT_TOKENS
    default_duration = 10.0  # seconds, StableAudio3Pipeline.__call__ default

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype=torch.float32, **kwargs) -> "StableAudio3Adapter":
        """Load a StableAudio3Pipeline folder (download Hub checkpoints first: no network at run time)."""
        if kwargs:
            raise ValueError(f"StableAudio3Adapter.from_pretrained takes no extra arguments; got {sorted(kwargs)}")
        pipe = load_pipeline(StableAudio3LoraPipeline, path, device=device, dtype=dtype)
        if type(pipe.transformer) is StableAudio3DiTModel:
            pipe.transformer.__class__ = StableAudio3LoraDiT  # the trainer adds its LoRA with add_adapter
        adapter = cls(pipe, device=device, dtype=dtype)
        adapter.source = path
        return adapter

    @property
    def audio_sample_rate(self) -> int:
        """Hz of the waveforms (the SAME autoencoder's sampling_rate)."""
        return int(self.pipe.vae.config.sampling_rate)

    # ---- sizes ---------------------------------------------------------------------------------
    def duration(self, shape: SampleShape) -> float:
        """Seconds of audio a sample of `shape` has (its duration, else the pipeline's default)."""
        return self.default_duration if shape.duration is None else float(shape.duration)

    def _lengths(self, shape: SampleShape) -> tuple[int, int]:
        """(latent frames T', waveform samples T) for the shape's duration, as upstream computes them."""
        rate, ratio = self.audio_sample_rate, self.pipe.vae.downsampling_ratio
        seconds = self.duration(shape)
        return int(math.ceil(seconds * rate / ratio)), int(seconds * rate)

    def check_shape(self, shape: SampleShape) -> None:
        """duration > 0 seconds, at least one output sample; height, width and num_frames are not used (audio)."""
        seconds = self.duration(shape)
        if not seconds > 0 or self._lengths(shape)[1] < 1:
            raise ValueError(
                f"duration={seconds} s must be positive and last at least one sample at {self.audio_sample_rate} Hz "
                "(rollout.duration, in seconds)"
            )

    # ---- the sampling contract -----------------------------------------------------------------
    def encode_prompt(self, prompts: list[str], *, max_sequence_length: int | None = None) -> Encoding:
        """T5Gemma last hidden states of the prompts padded to the tokenizer length (at most 256), with their mask,
        as `StableAudio3Pipeline.encode_prompt`. Returns {"prompt_embeds": (B, L, D), "encoder_attention_mask":
        (B, L)}; the duration token is added per sample shape in velocity()."""
        tokenizer = self.pipe.tokenizer
        length = min(getattr(tokenizer, "model_max_length", MAX_TEXT_TOKENS), MAX_TEXT_TOKENS)
        if max_sequence_length is not None:
            if max_sequence_length < 1:
                raise ValueError(f"max_sequence_length={max_sequence_length} must be >= 1")
            length = max_sequence_length
        for i, prompt in enumerate(prompts):
            n_tokens = len(tokenizer(prompt).input_ids)
            if n_tokens > length:
                warnings.warn(
                    f"prompt {i} has {n_tokens} tokens, more than {length}: truncated (as the upstream pipeline does)",
                    stacklevel=2,
                )
        inputs = tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        encoder = self.pipe.text_encoder
        ids_BL, mask_BL = inputs.input_ids.to(encoder.device), inputs.attention_mask.to(encoder.device)
        with torch.no_grad():
            hidden_BLD = encoder(ids_BL, attention_mask=mask_BL)[0]
        return {
            "prompt_embeds": hidden_BLD.to(device=self.device, dtype=self.dtype),
            "encoder_attention_mask": mask_BL.to(self.device),
        }

    def sigmas(self, num_inference_steps: int, shape: SampleShape) -> torch.Tensor:
        """The log-SNR schedule after the folder scheduler's `set_timesteps(sigmas=...)`, ending in 0 (N + 1,)."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps} must be >= 1")
        scheduler = copy.deepcopy(self.pipe.scheduler)
        scheduler.set_timesteps(sigmas=logsnr_sigma_schedule(num_inference_steps, LOGSNR_MIN, LOGSNR_MAX), device="cpu")
        sigmas = scheduler.sigmas.to(torch.float32)
        assert sigmas.shape == (num_inference_steps + 1,) and sigmas[-1] == 0, "scheduler must end at sigma 0"
        return sigmas

    def prepare_latents(self, shape: SampleShape, generators: list[torch.Generator]) -> torch.Tensor:
        """(B, C, T') fp32 noise; sample i is upstream's draw for a batch of one with generators[i]."""
        self.check_shape(shape)
        one = (1, self.pipe.vae.config.latent_dim, self._lengths(shape)[0])
        noise = [randn_tensor(one, generator=g, device=self.device, dtype=torch.float32) for g in generators]
        return torch.cat(noise, dim=0)

    def _duration_embedding(self, shape: SampleShape, batch: int) -> torch.Tensor:
        """(batch, D) the duration's global conditioning vector (the embedder is never trained)."""
        seconds = torch.full((batch,), self.duration(shape), dtype=torch.float32, device=self.device)
        with torch.no_grad():
            return self.pipe.duration_embedder(seconds)

    def velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        encoding: Encoding,
        negative: Encoding | None,
        *,
        guidance_scale: float,
        shape: SampleShape,
    ) -> torch.Tensor:
        """Guided flow velocity (B, C, T') fp32; negative and positive in one forward when guidance_scale > 1."""
        cfg = self.uses_cfg(guidance_scale, negative)
        batch = latents.shape[0]
        timesteps = sigma.to(device=self.device, dtype=torch.float32) * self.pipe.scheduler.config.num_train_timesteps
        timesteps = timesteps.expand(batch)
        global_BD = self._duration_embedding(shape, batch)
        text, mask = _with_duration_token(encoding, global_BD, self.dtype)
        x = latents.to(self.dtype)
        if cfg:
            neg_text, neg_mask = _with_duration_token(negative, global_BD, self.dtype)
            if neg_text.shape[1] != text.shape[1]:
                # no cross-attention mask in SA3's DiT: extra padded tokens change the output
                raise ValueError(
                    f"prompt ({text.shape[1]} tokens) and negative ({neg_text.shape[1]} tokens) encodings differ in "
                    "length: encode both with the same max_sequence_length"
                )
            x, timesteps, global_BD = torch.cat([x, x]), torch.cat([timesteps, timesteps]), torch.cat([global_BD] * 2)
            text, mask = torch.cat([neg_text, text]), torch.cat([neg_mask, mask])
        with self.attention_context():
            pred = self.transformer(
                x,
                timesteps,
                encoder_hidden_states=text,
                global_hidden_states=global_BD.to(self.dtype),
                encoder_attention_mask=mask,
                return_dict=False,
            )[0].float()
        if not cfg:
            return pred
        uncond, cond = pred[:batch], pred[batch:]
        return uncond + guidance_scale * (cond - uncond)

    def decode(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """Stable Audio 3 makes no frames (visual is False): use decode_audio."""
        raise ValueError("stable_audio3 makes audio only: there are no frames to decode (use decode_audio)")

    @torch.no_grad()
    def decode_audio(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """float32 waveforms (B, 2, T) in [-1, 1] on the host: the VAE's decode cut to the duration and clamped, as
        the pipeline's "pt"/"np" output."""
        vae = self.pipe.vae
        audio_BCT = vae.decode(latents.to(vae.device, dtype=vae.dtype)).sample
        return audio_BCT[:, :, : self._lengths(shape)[1]].clamp(-1.0, 1.0).float().cpu()


def _with_duration_token(encoding: Encoding, global_BD: torch.Tensor, dtype: torch.dtype):
    """(context (B, L + 1, D), mask (B, L + 1)): the text tokens, then the duration embedding as one always-valid
    token, as `StableAudio3Pipeline.prepare_cross_attention`."""
    embeds, mask = encoding["prompt_embeds"].to(dtype), encoding["encoder_attention_mask"]
    context = torch.cat([embeds, global_BD.unsqueeze(1).to(dtype)], dim=1)
    return context, torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
