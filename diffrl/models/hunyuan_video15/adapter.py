"""HunyuanVideo-1.5 text-to-video as a diffrl model adapter.

Mirrors `diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5.HunyuanVideo15Pipeline` (diffusers 0.42.1):
- prompts go through Qwen2.5-VL's chat template with the pipeline's system message, padded to
  `max_sequence_length` + 108 tokens; the third hidden state from the end is kept, minus the template's first 108
  tokens (`prompt_template_encode_start_idx`), with its attention mask;
- the glyph encoder: the quoted texts of a prompt (`extract_glyph_texts`) through ByT5 (`text_encoder_2`, 256 tokens
  with a mask); a prompt without quoted text gets zeros and an all-zero mask;
- sigmas = linspace(1, 0, N + 1)[:-1] shifted by the folder's FlowMatchEuler scheduler (480p: shift 5), ending in 0;
- initial noise (B, C, F', H/16, W/16) drawn in the transformer dtype, F' = (num_frames - 1) // 4 + 1;
- the transformer takes the noisy latents, zero condition latents and a zero mask channel (2C + 1 channels), zero
  image embeddings (729 tokens, masked out), timestep = sigma * 1000 cast to the latents' dtype;
- guidance as the folder's `ClassifierFreeGuidance`: uncond + g (cond - uncond), on unless g == 1;
- decoding: latents / scaling_factor through AutoencoderKLHunyuanVideo15, postprocessed to "np" frames.

Deviations (documented, by design):
- Upstream pads the Qwen text to 1000 tokens and the glyph text to 256; the transformer moves each sample's valid
  tokens first and masks the rest out of the attention, and zeroes them. Here each encoding keeps its valid tokens
  only (a batch right-pads with zeros under a zero mask, at least one glyph token), which the transformer treats
  identically up to float rounding; the prompt-embedding cache then holds tens of tokens a prompt instead of 1256.
- Cond and uncond run in ONE batched forward (upstream runs two); equal up to float rounding.
- CFG is on for guidance_scale > 1 (upstream's guider: any scale but 1); folders whose guider rescales, uses the
  original formulation or a start/stop window are refused.
- The pipeline class is `HunyuanVideo15LoraPipeline`: diffusers 0.42.1 gives HunyuanVideo15Pipeline no LoRA loader,
  so checkpoints write their LoRA through HunyuanVideo's (transformer-only, diffusers key format). A plain
  HunyuanVideo15Pipeline loads it with `pipe.transformer.load_lora_adapter(file, prefix="transformer")`.
- Sizes the pipeline silently rounds down (height/width not a multiple of 16, num_frames not 1 mod 4) are a
  ValueError here.

Legend: B batch, C latent channels, F' latent frames, H'/W' latent height/width, T Qwen text tokens, T2 glyph
tokens, D / D2 their hidden sizes, F/H/W output frames/height/width.
"""

from __future__ import annotations

import copy
import warnings
from typing import ClassVar

import numpy as np
import torch
from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline
from diffusers.loaders import HunyuanVideoLoraLoaderMixin
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import (
    extract_glyph_texts,
    format_text_input,
    retrieve_timesteps,
)
from diffusers.utils.torch_utils import randn_tensor

from diffrl.models.base import (
    Encoding,
    ModelAdapter,
    SampleShape,
    load_pipeline,
    pad_and_cat,
    pad_tokens,
    register_adapter,
    text_bucket,
)

TEXT_KEYS = ("prompt_embeds", "prompt_embeds_mask")  # Qwen2.5-VL tokens
GLYPH_KEYS = ("prompt_embeds_2", "prompt_embeds_mask_2")  # ByT5 tokens of the quoted texts
# The pipeline's hidden state: `hidden_states[-(num_hidden_layers_to_skip + 1)]` with its default skip of 2.
_HIDDEN_LAYERS_TO_SKIP = 2


class HunyuanVideo15LoraPipeline(HunyuanVideoLoraLoaderMixin, HunyuanVideo15Pipeline):
    """HunyuanVideo15Pipeline with diffusers' transformer-only LoRA loader (`save_lora_weights`, `load_lora_weights`,
    `fuse_lora`): HunyuanVideo's mixin, which puts a diffusers-format LoRA into any transformer through peft."""


@register_adapter
class HunyuanVideo15Adapter(ModelAdapter):
    """HunyuanVideo-1.5 text-to-video (8.3B dual-stream DiT, Qwen2.5-VL + ByT5 glyph text, 16x spatial VAE)."""

    arch: ClassVar[str] = "hunyuan_video15"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("HunyuanVideo15Pipeline",)
    is_video: ClassVar[bool] = True
    # The joint attention's projections of both streams (video: to_*, text: add_*_proj / to_add_out); the token
    # refiner's self-attention shares the to_q/to_k/to_v/to_out.0 names. DanceGRPO trains HunyuanVideo in full and
    # publishes no LoRA targets.
    default_lora_targets: ClassVar[tuple[str, ...]] = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
    )
    default_guidance_scale: ClassVar[float] = 6.0  # the 480p / 720p T2V folders' guider
    default_max_sequence_length: ClassVar[int] = 1000  # HunyuanVideo15Pipeline.tokenizer_max_length

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype=torch.float32, **kwargs) -> "HunyuanVideo15Adapter":
        """Load a HunyuanVideo15Pipeline folder with `dtype` on `device` (download Hub checkpoints first)."""
        if kwargs:
            raise ValueError(f"unexpected options for hunyuan_video15: {sorted(kwargs)}; it takes none")
        pipe = load_pipeline(HunyuanVideo15LoraPipeline, path, device=device, dtype=dtype)
        _check_guider(pipe.guider, path)
        adapter = cls(pipe, device=device, dtype=dtype)
        adapter.source = path
        return adapter

    # ---- geometry --------------------------------------------------------------------------------
    def _multiple(self) -> int:
        return self.pipe.vae_scale_factor_spatial * self.transformer.config.patch_size

    def check_shape(self, shape: SampleShape) -> None:
        """height/width multiples of the VAE factor x patch size (16); num_frames = 1 mod the temporal factor (4)."""
        multiple = self._multiple()
        for name, value in (("height", shape.height), ("width", shape.width)):
            if value <= 0 or value % multiple:
                raise ValueError(
                    f"{name}={value} must be a positive multiple of {multiple} "
                    f"(VAE scale factor x transformer patch size) for HunyuanVideo-1.5"
                )
        temporal = self.pipe.vae_scale_factor_temporal
        if shape.num_frames < 1 or (shape.num_frames - 1) % temporal:
            raise ValueError(
                f"num_frames={shape.num_frames} must be k * {temporal} + 1 (e.g. 1, 5, ..., 121) "
                f"for HunyuanVideo-1.5's temporal VAE factor {temporal}"
            )

    def _latent_shape(self, shape: SampleShape) -> tuple[int, int, int, int]:
        spatial = self.pipe.vae_scale_factor_spatial
        frames = (shape.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        return (self.pipe.num_channels_latents, frames, shape.height // spatial, shape.width // spatial)

    # ---- text ------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompt(self, prompts: list[str], *, max_sequence_length: int | None = None) -> Encoding:
        """{"prompt_embeds": (B, T, D), "prompt_embeds_mask": (B, T) int64, "prompt_embeds_2": (B, T2, D2),
        "prompt_embeds_mask_2": (B, T2) int64}: upstream's `encode_prompt` with the padding dropped."""
        max_len = self.default_max_sequence_length if max_sequence_length is None else max_sequence_length
        if max_len < 1:
            raise ValueError(f"max_sequence_length={max_sequence_length} must be >= 1 (HunyuanVideo-1.5's is 1000)")
        qwen = self._qwen_embeds(prompts, max_len)
        glyph = self._glyph_embeds(prompts)
        return {**qwen, **glyph}

    def _qwen_embeds(self, prompts: list[str], max_len: int) -> Encoding:
        """Qwen2.5-VL's hidden states of the prompts' valid tokens after the template prefix, as
        `_get_mllm_prompt_embeds` computes them (padded to max_len + prefix, the same mask)."""
        pipe = self.pipe
        crop = pipe.prompt_template_encode_start_idx
        messages = format_text_input(prompts, pipe.system_message)
        self._warn_if_truncated(messages, crop, max_len)
        tokens = pipe.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            padding="max_length",
            max_length=max_len + crop,
            truncation=True,
            return_tensors="pt",
        )
        encoder = pipe.text_encoder
        ids_BT, mask_BT = tokens["input_ids"].to(encoder.device), tokens["attention_mask"].to(encoder.device)
        hidden_BTD = encoder(input_ids=ids_BT, attention_mask=mask_BT, output_hidden_states=True).hidden_states[
            -(_HIDDEN_LAYERS_TO_SKIP + 1)
        ]
        hidden_BTD, keep_BT = hidden_BTD[:, crop:], mask_BT[:, crop:].bool()
        return _valid_tokens([h[m] for h, m in zip(hidden_BTD, keep_BT)], TEXT_KEYS, self.dtype, self.device)

    def _warn_if_truncated(self, messages: list, crop: int, max_len: int) -> None:
        untruncated = self.pipe.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for i, ids in enumerate(untruncated):
            if len(ids) - crop > max_len:
                warnings.warn(
                    f"prompt {i} has {len(ids) - crop} tokens, more than max_sequence_length={max_len}: truncated to "
                    f"{max_len} tokens (as HunyuanVideo15Pipeline does)",
                    stacklevel=4,
                )  # the caller of encode_prompt (past no_grad)

    def _glyph_embeds(self, prompts: list[str]) -> Encoding:
        """ByT5 states of each prompt's quoted texts (`_get_byt5_prompt_embeds`); none for a prompt without."""
        pipe, per_prompt = self.pipe, []
        encoder = pipe.text_encoder_2
        for prompt in prompts:
            glyph_text = extract_glyph_texts(prompt)
            if glyph_text is None:  # upstream: zeros under an all-zero mask
                per_prompt.append(torch.zeros(0, encoder.config.d_model, dtype=encoder.dtype, device=encoder.device))
                continue
            tokens = pipe.tokenizer_2(
                glyph_text,
                padding="max_length",
                max_length=pipe.tokenizer_2_max_length,
                truncation=True,
                add_special_tokens=True,
                return_tensors="pt",
            ).to(encoder.device)
            hidden_1TD = encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask.float())[0]
            per_prompt.append(hidden_1TD[0][tokens.attention_mask[0].bool()])
        return _valid_tokens(per_prompt, GLYPH_KEYS, self.dtype, self.device)

    # ---- schedule and noise ----------------------------------------------------------------------
    def sigmas(self, num_inference_steps: int, shape: SampleShape) -> torch.Tensor:
        """(N + 1,) fp32: the scheduler's sigmas after the pipeline's `retrieve_timesteps(sigmas=linspace)` call."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps} must be >= 1")
        scheduler = copy.deepcopy(self.pipe.scheduler)  # set_timesteps mutates it
        base = np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1]
        retrieve_timesteps(scheduler, num_inference_steps, "cpu", sigmas=base)
        sigmas = scheduler.sigmas.to(torch.float32)
        assert sigmas.shape == (num_inference_steps + 1,) and sigmas[-1] == 0, "scheduler must end at sigma 0"
        return sigmas

    def prepare_latents(self, shape: SampleShape, generators: list[torch.Generator]) -> torch.Tensor:
        """(B, C, F', H', W') fp32 noise; sample i is upstream's draw (in the model dtype) for one video with
        generators[i]."""
        self.check_shape(shape)
        one = (1, *self._latent_shape(shape))
        noise = [randn_tensor(one, generator=g, device=self.device, dtype=self.dtype) for g in generators]
        return torch.cat(noise).to(torch.float32)

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
        """Guided flow velocity (B, C, F', H', W') fp32; cond and uncond in one forward when CFG is on."""
        cfg = self.uses_cfg(guidance_scale, negative)
        batch = latents.shape[0]
        x = latents.to(device=self.device, dtype=self.dtype)
        # t2v: the condition latents and the condition mask are zeros (`prepare_cond_latents_and_mask`)
        x = torch.cat([x, torch.zeros_like(x), torch.zeros_like(x[:, :1])], dim=1)
        # Upstream: t = sigma * 1000 (the scheduler's fp32 timesteps) cast to the latents' dtype.
        timestep_B = (sigma.to(device=self.device, dtype=torch.float32) * 1000).expand(batch).to(self.dtype)
        text = pad_and_cat([encoding, negative]) if cfg else encoding
        text = self._bucketed(text)
        if cfg:
            x, timestep_B = torch.cat([x, x]), torch.cat([timestep_B, timestep_B])
        # t2v: no image, so zero vision states, which the transformer masks out (`torch.all(image_embeds == 0)`).
        image_embeds = torch.zeros(
            x.shape[0],
            self.pipe.vision_num_semantic_tokens,
            self.transformer.config.image_embed_dim,
            dtype=self.dtype,
            device=self.device,
        )
        pred = self.transformer(
            hidden_states=x,
            image_embeds=image_embeds,
            timestep=timestep_B,
            encoder_hidden_states=text["prompt_embeds"].to(self.dtype),
            encoder_attention_mask=text["prompt_embeds_mask"],
            encoder_hidden_states_2=text["prompt_embeds_2"].to(self.dtype),
            encoder_attention_mask_2=text["prompt_embeds_mask_2"],
            return_dict=False,
        )[0].float()
        if not cfg:
            return pred
        cond, uncond = pred[:batch], pred[batch:]
        return uncond + guidance_scale * (cond - uncond)

    def _bucketed(self, text: Encoding) -> Encoding:
        """Once the blocks are compiled, both texts padded to their `text_bucket` lengths (padded tokens are masked
        out), so prompts of different lengths share a few static graphs; unchanged otherwise."""
        if not self.compiled:
            return text
        text = pad_tokens(text, TEXT_KEYS, text_bucket(text["prompt_embeds"].shape[1]))
        return pad_tokens(text, GLYPH_KEYS, text_bucket(text["prompt_embeds_2"].shape[1]))

    # ---- pixels ----------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """uint8 videos (B, F, H, W, 3), equal to the pipeline's output_type="np" frames x 255 rounded."""
        vae = self.pipe.vae
        z = latents.to(vae.device, dtype=vae.dtype) / vae.config.scaling_factor
        # One video at a time: the VAE's mid-block attention builds its causal mask for a batch it cannot broadcast
        # (diffusers 0.42.1 fails for more than one video; the pipeline decodes the batch it generated).
        video_BCFHW = torch.cat([vae.decode(z_1, return_dict=False)[0] for z_1 in z.split(1)])
        frames = self.pipe.video_processor.postprocess_video(video_BCFHW, output_type="np")  # (B, F, H, W, 3)
        return torch.from_numpy((frames * 255).round().astype(np.uint8))


def _valid_tokens(per_prompt: list[torch.Tensor], keys: tuple[str, str], dtype, device) -> Encoding:
    """{keys[0]: (B, T, D) the prompts' valid token states right-padded with zeros, keys[1]: (B, T) int64 mask}; at
    least one (masked) token, so a batch without any valid token keeps its shape."""
    longest = max(1, *(e.shape[0] for e in per_prompt))
    embeds = torch.stack([torch.cat([e, e.new_zeros(longest - e.shape[0], e.shape[1])]) for e in per_prompt])
    mask = torch.stack([torch.arange(longest, device=device) < e.shape[0] for e in per_prompt]).long()
    return {keys[0]: embeds.to(device=device, dtype=dtype), keys[1]: mask}


def _check_guider(guider, path: str) -> None:
    """ValueError unless the folder's guider is plain CFG (what `velocity` computes)."""
    config = getattr(guider, "config", {})
    plain = (
        isinstance(guider, ClassifierFreeGuidance)
        and config.get("guidance_rescale", 0.0) == 0.0
        and not config.get("use_original_formulation", False)
        and config.get("start", 0.0) == 0.0
        and config.get("stop", 1.0) == 1.0
        and config.get("enabled", True)
    )
    if not plain:
        raise ValueError(
            f"{path!r}: diffrl runs HunyuanVideo-1.5 with plain classifier-free guidance (uncond + g (cond - uncond) "
            f"at every step); this folder's guider is {type(guider).__name__} {dict(config)}"
        )
