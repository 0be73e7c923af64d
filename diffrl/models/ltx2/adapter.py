"""LTX-2 text-to-video-with-audio as a diffrl model adapter: one transformer denoises a video and its sound together.

Mirrors `diffusers.pipelines.ltx2.pipeline_ltx2.LTX2Pipeline` (diffusers 0.42.1): Gemma-3 hidden states of every layer
(prompts left-padded to `max_sequence_length`, default 1024) through the connectors, which give a video and an audio
text stream and their mask; video latents (B, C, F', H', W') packed into tokens, audio latents (B, C_a, L_a, M')
packed into tokens (B, L_a, C_a * M'); one sigma schedule for both, shifted by mu from the video token count; the
transformer gets timestep = sigma = sigma * 1000 for both streams; guidance per stream in x0 space (x0 = x - sigma v)
with the delta formulation, x0 = x0_cond + (g - 1) (x0_cond - x0_uncond), `guidance_scale` on the video and
`audio_guidance_scale` on the audio, each optionally rescaled (`guidance_rescale`, `audio_guidance_rescale`:
rescale_noise_cfg against x0_cond, std over the stream's tokens and channels), and back to a velocity.

The packed latent: ONE fp32 tensor per sample, latents (B, N) with N = L_v C_v + L_a C_a, the video tokens
(B, L_v, C_v) flattened, then the audio tokens (B, L_a, C_a') flattened, each in upstream's own token order and
normalisation (what LTX2Pipeline denoises). A flat concatenation holds no padding, so every element is a value one of
the two streams denoises.

Log-probs of the packed tensor: the engines' Gaussian SDE log-prob (diffrl/algorithms/sde.py) is the MEAN of the
elementwise log-densities over a sample's non-batch elements. With lp_v and lp_a the mean elementwise log-probs of the
video and audio elements and N_v = L_v C_v, N_a = L_a C_a' their counts,

    log_prob = (N_v lp_v + N_a lp_a) / (N_v + N_a),

the element-weighted average of the two streams' (every stream's noise and step coefficients are the same, the
sigmas being shared). At LTX-2's 512x768, 121 frames at 24 fps: N_v = 16 x 24 x 16 x 128 = 786,432, N_a = 126 x 128
= 16,128: the audio carries 2 % of the log-prob's weight, as it carries 2 % of the sampled values.

Legend: B batch, L_v video tokens (F' H' W'), C_v video latent channels, L_a latent audio frames, C_a' audio latent
channels x latent mel bins, T text tokens, D text widths, F/H/W output frames/height/width.

Deviations from the upstream pipeline (by design):
- Spatio-temporal guidance (STG) and modality-isolation guidance (each an extra transformer forward per step) are not
  implemented; upstream's call defaults turn them on (stg_scale 1.0 at block 28, modality_scale 3.0), so parity holds
  with `stg_scale=0, audio_stg_scale=0, modality_scale=1, audio_modality_scale=1`. Asking for them is a ValueError.
- The knobs default to: audio_guidance_scale None (= the video guidance scale, upstream's rule for None; its call
  default is 7.0), guidance_rescale 0.0 (upstream's call default 0.7), frame_rate 24.0 (upstream's default).
- Prompt enhancement, a duration head, motion speed and decode-time noise are not supported (T2AV at a fixed size).
- Sizes the pipeline would round are a ValueError; cond and uncond run in ONE batched forward, as upstream.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import torch
from diffusers import LTX2Pipeline
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, rescale_noise_cfg, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from diffrl.models.base import Encoding, ModelAdapter, SampleShape, load_pipeline, register_adapter

UNSUPPORTED = (
    "stg_scale",
    "audio_stg_scale",
    "modality_scale",
    "audio_modality_scale",
    "spatio_temporal_guidance_blocks",
)


@register_adapter
class LTX2Adapter(ModelAdapter):
    """LTX-2 (LTX2Pipeline folders: Lightricks/LTX-2, LTX-2.3): video (B, F, H, W, 3) with a waveform (B, C, T).

    Knobs (from_pretrained arguments, or set the attributes later): audio_guidance_scale (None: the video scale),
    guidance_rescale, audio_guidance_rescale (None: guidance_rescale), frame_rate (frames per second: the video's
    RoPE positions and the audio's length, num_frames / frame_rate seconds).
    """

    arch = "ltx2"
    pipeline_classes = ("LTX2Pipeline",)
    is_video = True
    has_audio = True
    visual = True
    # VeRL-Omni's LTX-2.3 LoRA recipe: the q/k/v/out projections of all six attentions of a block (video and audio
    # self-attention, their text cross-attention, audio-to-video and video-to-audio) and both feed-forwards.
    default_lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "ff.net.0.proj",
        "ff.net.2",
        "audio_ff.net.0.proj",
        "audio_ff.net.2",
    )
    default_guidance_scale = 3.0  # LTX2Pipeline.__call__ default
    default_max_sequence_length = 1024  # LTX2Pipeline.__call__ default

    def __init__(
        self,
        pipe: LTX2Pipeline,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        audio_guidance_scale: float | None = None,
        guidance_rescale: float = 0.0,
        audio_guidance_rescale: float | None = None,
        frame_rate: float = 24.0,
    ):
        super().__init__(pipe, device=device, dtype=dtype)
        self.audio_guidance_scale = audio_guidance_scale
        self.guidance_rescale = float(guidance_rescale)
        self.audio_guidance_rescale = audio_guidance_rescale
        if not frame_rate > 0:
            raise ValueError(f"frame_rate={frame_rate} must be > 0 (frames per second)")
        self.frame_rate = float(frame_rate)

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype=torch.float32, **kwargs) -> "LTX2Adapter":
        """Load an LTX2Pipeline folder (download Hub checkpoints first: no network at run time). Takes the knobs of
        the class docstring; STG and modality-isolation guidance are refused."""
        refused = sorted(set(kwargs) & set(UNSUPPORTED))
        if refused:
            raise ValueError(
                f"ltx2: {refused} not supported: spatio-temporal and modality-isolation guidance (an extra transformer "
                "forward each per step) are not implemented; the adapter applies CFG and guidance rescale only"
            )
        knobs = {"audio_guidance_scale", "guidance_rescale", "audio_guidance_rescale", "frame_rate"}
        if set(kwargs) - knobs:
            raise ValueError(f"ltx2: unknown options {sorted(set(kwargs) - knobs)}; it takes {sorted(knobs)}")
        pipe = load_pipeline(LTX2Pipeline, path, device=device, dtype=dtype)
        adapter = cls(pipe, device=device, dtype=dtype, **kwargs)
        adapter.source = path
        return adapter

    # ---- what the audio path reads ---------------------------------------------------------------
    @property
    def fps(self) -> float:
        """Frames per second of decode()'s videos (= frame_rate)."""
        return self.frame_rate

    @property
    def audio_sample_rate(self) -> int:
        """Hz of decode_audio()'s waveforms: the vocoder's output rate."""
        return int(self.pipe.vocoder.config.output_sampling_rate)

    def _audio_scale(self, guidance_scale: float) -> float:
        return guidance_scale if self.audio_guidance_scale is None else float(self.audio_guidance_scale)

    def _audio_rescale(self) -> float:
        return self.guidance_rescale if self.audio_guidance_rescale is None else float(self.audio_guidance_rescale)

    def needs_negative(self, guidance_scale: float) -> bool:
        """CFG runs when either stream's scale is > 1 (upstream's switch)."""
        return guidance_scale > 1.0 or self._audio_scale(guidance_scale) > 1.0

    # ---- shapes ----------------------------------------------------------------------------------
    def check_shape(self, shape: SampleShape) -> None:
        """height/width multiples of 32 (upstream's check) and of the VAE factor x patch; num_frames = 8k + 1."""
        spatial = self.pipe.vae_spatial_compression_ratio * self.pipe.transformer_spatial_patch_size
        multiple = int(np.lcm(32, spatial))
        for name, value in (("height", shape.height), ("width", shape.width)):
            if value <= 0 or value % multiple:
                raise ValueError(f"{name}={value} must be a positive multiple of {multiple} for LTX-2")
        temporal = self.pipe.vae_temporal_compression_ratio * self.pipe.transformer_temporal_patch_size
        if shape.num_frames < 1 or (shape.num_frames - 1) % temporal:
            raise ValueError(
                f"num_frames={shape.num_frames} must be k * {temporal} + 1 (e.g. 9, 17, ..., 121) for LTX-2's "
                f"temporal VAE factor {temporal}"
            )

    def _video_grid(self, shape: SampleShape) -> tuple[int, int, int]:
        """(F', H', W') of the video latents (patch size 1, as every LTX-2 transformer)."""
        pipe = self.pipe
        return (
            (shape.num_frames - 1) // pipe.vae_temporal_compression_ratio + 1,
            shape.height // pipe.vae_spatial_compression_ratio,
            shape.width // pipe.vae_spatial_compression_ratio,
        )

    def _audio_frames(self, shape: SampleShape) -> int:
        """L_a: upstream's round(num_frames / frame_rate x latent audio frames per second)."""
        pipe = self.pipe
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        return round(shape.num_frames / self.frame_rate * per_second)

    def _mel_bins(self) -> int:
        """M': latent mel bins."""
        return self.pipe.audio_vae.config.mel_bins // self.pipe.audio_vae_mel_compression_ratio

    def stream_sizes(self, shape: SampleShape) -> tuple[int, int]:
        """(N_v, N_a): how many of a packed sample's values are video, then audio."""
        frames, height, width = self._video_grid(shape)
        video = frames * height * width * self.transformer.config.in_channels
        audio = self._audio_frames(shape) * self.pipe.audio_vae.config.latent_channels * self._mel_bins()
        return video, audio

    def split(self, latents: torch.Tensor, shape: SampleShape) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed (B, N) -> video tokens (B, L_v, C_v) and audio tokens (B, L_a, C_a') (views)."""
        n_video, n_audio = self.stream_sizes(shape)
        if latents.dim() != 2 or latents.shape[1] != n_video + n_audio:
            raise ValueError(f"ltx2 latents for {shape} are (B, {n_video} + {n_audio}); got {tuple(latents.shape)}")
        video = latents[:, :n_video].unflatten(1, (-1, self.transformer.config.in_channels))
        audio = latents[:, n_video:].unflatten(1, (self._audio_frames(shape), -1))
        return video, audio

    @staticmethod
    def pack(video_BLC: torch.Tensor, audio_BLC: torch.Tensor) -> torch.Tensor:
        """Video tokens (B, L_v, C_v) and audio tokens (B, L_a, C_a') -> packed (B, N)."""
        return torch.cat([video_BLC.flatten(1), audio_BLC.flatten(1)], dim=1)

    # ---- text ------------------------------------------------------------------------------------
    def encode_prompt(self, prompts: list[str], *, max_sequence_length: int | None = None) -> Encoding:
        """Gemma-3 hidden states of every layer through the connectors, as upstream's encode_prompt + connectors.
        Returns {"prompt_embeds": (B, T, D_v), "audio_prompt_embeds": (B, T, D_a), "prompt_attention_mask": (B, T)},
        T = max_sequence_length."""
        max_len = self.default_max_sequence_length if max_sequence_length is None else max_sequence_length
        registers = self.pipe.connectors.video_connector.num_learnable_registers
        if max_len < 1 or (registers and max_len % registers):
            raise ValueError(
                f"max_sequence_length={max_len} must be a positive multiple of the connectors' {registers} learnable "
                "registers (LTX-2's default is 1024)"
            )
        tokenizer = self.pipe.tokenizer
        tokenizer.padding_side = "left"  # as upstream's _get_gemma_prompt_embeds sets it
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        texts = [p.strip() for p in prompts]
        for i, text in enumerate(texts):
            n_tokens = len(tokenizer(text, add_special_tokens=True).input_ids)
            if n_tokens > max_len:
                warnings.warn(
                    f"prompt {i} has {n_tokens} tokens, more than max_sequence_length={max_len}: truncated to "
                    f"{max_len} tokens (as the upstream LTX-2 pipeline does)",
                    stacklevel=2,
                )
        inputs = tokenizer(
            texts,
            padding="max_length",
            max_length=max_len,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        encoder = self.pipe.text_encoder
        ids_BT, mask_BT = inputs.input_ids.to(encoder.device), inputs.attention_mask.to(encoder.device)
        with torch.no_grad():
            hidden = encoder(input_ids=ids_BT, attention_mask=mask_BT, output_hidden_states=True).hidden_states
            embeds_BTD = torch.stack(hidden, dim=-1).flatten(2, 3).to(encoder.dtype)
            video_BTD, audio_BTD, mask = self.pipe.connectors(embeds_BTD, mask_BT, padding_side="left")
        return {
            "prompt_embeds": video_BTD.to(device=self.device, dtype=self.dtype),
            "audio_prompt_embeds": audio_BTD.to(device=self.device, dtype=self.dtype),
            "prompt_attention_mask": mask.to(self.device),
        }

    # ---- schedule and noise ----------------------------------------------------------------------
    def sigmas(self, num_inference_steps: int, shape: SampleShape) -> torch.Tensor:
        """(N + 1,) fp32: the scheduler's sigmas after upstream's retrieve_timesteps (mu from the video tokens)."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps} must be >= 1")
        self.check_shape(shape)
        config = self.pipe.scheduler.config
        mu = calculate_shift(
            int(np.prod(self._video_grid(shape))),
            config.get("base_image_seq_len", 1024),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.95),
            config.get("max_shift", 2.05),
        )
        scheduler = copy.deepcopy(self.pipe.scheduler)  # set_timesteps mutates it
        base = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        retrieve_timesteps(scheduler, num_inference_steps, "cpu", sigmas=base, mu=mu)
        return scheduler.sigmas.to(torch.float32)

    def prepare_latents(self, shape: SampleShape, generators: list[torch.Generator]) -> torch.Tensor:
        """Packed noise (B, N) fp32; sample i is upstream's draw for one video with generators[i]: its video noise
        (1, C_v, F', H', W'), then its audio noise (1, C_a, L_a, M') from the same generator."""
        self.check_shape(shape)
        pipe = self.pipe
        video_shape = (1, self.transformer.config.in_channels, *self._video_grid(shape))
        audio_shape = (1, pipe.audio_vae.config.latent_channels, self._audio_frames(shape), self._mel_bins())
        samples = []
        for generator in generators:
            video = randn_tensor(video_shape, generator=generator, device=self.device, dtype=torch.float32)
            audio = randn_tensor(audio_shape, generator=generator, device=self.device, dtype=torch.float32)
            samples.append(self.pack(pipe._pack_latents(video), pipe._pack_audio_latents(audio)))
        return torch.cat(samples)

    # ---- denoiser --------------------------------------------------------------------------------
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
        """Guided packed velocity (B, N) fp32 at per-sample sigmas (B,) > 0: one transformer forward ([uncond; cond]
        batched as upstream when CFG is on), guidance per stream in x0 space, back to velocities."""
        cfg = self.uses_cfg(guidance_scale, negative)
        batch = latents.shape[0]
        video, audio = self.split(latents.to(self.device), shape)
        sigma_B = sigma.to(device=self.device, dtype=torch.float32).expand(batch)
        timestep_B = sigma_B * self.pipe.scheduler.config.num_train_timesteps
        text = encoding
        if cfg:
            text = {k: torch.cat([negative[k], encoding[k]]) for k in encoding}
        rows = 2 if cfg else 1
        frames, height, width = self._video_grid(shape)
        with self.attention_context():
            pred_video, pred_audio = self.transformer(
                hidden_states=torch.cat([video] * rows).to(self.dtype),
                audio_hidden_states=torch.cat([audio] * rows).to(self.dtype),
                encoder_hidden_states=text["prompt_embeds"].to(self.dtype),
                audio_encoder_hidden_states=text["audio_prompt_embeds"].to(self.dtype),
                timestep=torch.cat([timestep_B] * rows),
                sigma=torch.cat([timestep_B] * rows),  # LTX-2.3's prompt modulation reads it; upstream passes t
                encoder_attention_mask=text["prompt_attention_mask"],
                audio_encoder_attention_mask=text["prompt_attention_mask"],
                num_frames=frames,
                height=height,
                width=width,
                fps=self.frame_rate,
                audio_num_frames=self._audio_frames(shape),
                use_cross_timestep=True,  # upstream's default; both streams share one timestep here
                return_dict=False,
            )
        scales = (guidance_scale, self._audio_scale(guidance_scale))
        rescales = (self.guidance_rescale, self._audio_rescale())
        guided = [
            guided_velocity(x.float(), pred.float(), sigma_B, cfg, scale, rescale)
            for x, pred, scale, rescale in zip((video, audio), (pred_video, pred_audio), scales, rescales)
        ]
        return self.pack(*guided)

    # ---- outputs ---------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """uint8 videos (B, F, H, W, 3), equal to the pipeline's output_type="np" frames x 255, rounded."""
        pipe, vae = self.pipe, self.pipe.vae
        video, _ = self.split(latents.to(self.device), shape)
        z = pipe._unpack_latents(video, *self._video_grid(shape)).to(self.dtype)  # upstream: prompt_embeds' dtype
        timestep = None
        if vae.config.timestep_conditioning:  # decode_timestep 0 and decode noise scale 0: the latents unchanged
            timestep = torch.zeros(z.shape[0], device=z.device, dtype=z.dtype)
        z = pipe._denormalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor).to(vae.dtype)
        video_BCFHW = vae.decode(z, timestep, return_dict=False)[0]
        frames = pipe.video_processor.postprocess_video(video_BCFHW, output_type="np")  # (B, F, H, W, 3)
        return torch.from_numpy((frames * 255).round().astype(np.uint8))

    @torch.no_grad()
    def decode_audio(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """float32 waveforms (B, C, T) on the host: the audio VAE's mel spectrogram through the vocoder, as the
        pipeline's `audio` output (T = the mel frames x the vocoder's upsampling)."""
        pipe = self.pipe
        _, audio = self.split(latents.to(self.device), shape)
        audio_vae = pipe.audio_vae
        # upstream denormalises the fp32 tokens, then unpacks and casts to the audio VAE's dtype
        audio = pipe._denormalize_audio_latents(audio.float(), audio_vae.latents_mean, audio_vae.latents_std)
        audio_BCLM = pipe._unpack_audio_latents(audio, self._audio_frames(shape), num_mel_bins=self._mel_bins())
        mel = audio_vae.decode(audio_BCLM.to(audio_vae.dtype), return_dict=False)[0]
        return pipe.vocoder(mel).float().cpu()


def guided_velocity(
    x: torch.Tensor,
    pred: torch.Tensor,
    sigma_B: torch.Tensor,
    cfg: bool,
    guidance_scale: float,
    guidance_rescale: float,
) -> torch.Tensor:
    """One stream's guided velocity (B, L, C) fp32, as LTX2Pipeline: x0 = x - sigma v for [uncond; cond] (or cond
    alone), x0 = x0_cond + (g - 1)(x0_cond - x0_uncond), rescale_noise_cfg against x0_cond when rescale > 0, then
    v = (x - x0) / sigma. `pred` holds 2B rows ([uncond; cond]) when `cfg`, else B."""
    sigma = sigma_B.view(-1, *([1] * (x.dim() - 1)))
    if cfg:
        uncond, cond = pred.chunk(2)
        x0_cond, x0_uncond = x - cond * sigma, x - uncond * sigma
        x0 = x0_cond + (guidance_scale - 1) * (x0_cond - x0_uncond)
    else:
        x0_cond = x0 = x - pred * sigma
    if guidance_rescale > 0:
        x0 = rescale_noise_cfg(x0, x0_cond, guidance_rescale=guidance_rescale)
    return (x - x0) / sigma
