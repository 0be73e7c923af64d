"""Janus-Pro image generation as an autoregressive token policy: transformers' ``JanusForConditionalGeneration`` read
from a local folder samples each image as a sequence of VQ image tokens with classifier-free guidance, records their
per-token log-probs, replays them teacher-forced (differentiable, for the trainer) and decodes them to pixels.

Janus-Pro: Chen et al., 2025, "Janus-Pro: Unified Multimodal Understanding and Generation with Data and Model Scaling".
The policy plugs into the token family (the TransformersTokenEngine rollout, TokenTrainer, the token store) as
CausalLMPolicy does (diffrl/models/causal_lm/policy.py); its responses are image tokens, its outputs decoded images.

Legend: B rows (prompts times samples), P prompt tokens (left-padded), T image tokens (num_image_tokens: 576 for
Janus-Pro, 16 for the tiny model), V the image codebook size, D the language model's hidden size.

Sampling, as transformers' `generate(..., generation_mode="image")` and DeepSeek's own generation script:
- the prompt is Janus' SFT turn with an empty system prompt, then the begin-of-image token:
  ``<bos><|User|>: {prompt}\\n\\n<|Assistant|>:<begin_of_image>``;
- the unconditional row is the same ids with every token but BOS and begin-of-image replaced by the pad token (and
  the same attention mask);
- at each of the T positions the cond and uncond rows run in one batch of 2B through the language model; the
  generation head gives logits (2B, V); logits = uncond + s (cond - uncond) (s = guidance_scale), divided by the
  temperature, softmax, one multinomial draw per row (argmax at temperature 0); the drawn token enters both rows
  through the generation embeddings and aligner.

The recorded log-prob is that of the distribution actually sampled: log softmax((uncond + s (cond - uncond)) / T_temp),
and the replay computes the same thing from two teacher-forced passes (cond and uncond batched as 2B rows), so the
importance ratio of GRPO/GSPO compares like with like and is exactly 1 on policy. Gradients flow through both the
cond and uncond passes (one shared LoRA). Peer practice differs: the T2I-R1-style GRPO trainer for Janus of GCPO
(zghhui/GCPO, janus/src/gcpo/src/open_r1/trainer/gcpo_trainer.py) samples with CFG but trains the conditional pass's
log-probs alone (one forward, half the cost): its ratio is that of another distribution than the one sampled.

Deviations: top-p / top-k truncation is not supported (Janus samples the full distribution; a top_p < 1 is a
ValueError); position ids are counted over the attention mask, so a left-padded prompt gets the positions it would
have alone (transformers' image generation, prompt by prompt, gives the same); text prompts only (no image inputs).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence

import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer, DynamicCache, GenerationConfig, JanusForConditionalGeneration

from diffrl.models.causal_lm.policy import (
    ATTENTION_PROJECTIONS,
    PromptInputs,
    SamplingParams,
    TokenPrompt,
    TokenSamples,
)
from diffrl.models.random_weights import SEED, seeded

JANUS_TYPES = ("janus",)
DEFAULT_GUIDANCE_SCALE = 5.0  # Janus-Pro's cfg_weight, and transformers' default for image generation
USER, ASSISTANT = "<|User|>", "<|Assistant|>"


def is_janus_folder(path: str) -> bool:
    """Whether a local model folder is a Janus checkpoint (config.json model_type "janus")."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return json.load(f).get("model_type") in JANUS_TYPES


class JanusImagePolicy:
    """Janus-Pro's text-to-image generation as a token policy. `model` is the module the trainer updates (LoRA on the
    language model's attention projections; the VQ-VAE and the vision encoder stay frozen); `sample` is the rollout,
    `replay` the trainer's teacher-forced log-probs, `decode` turns image tokens into uint8 images."""

    kind = "autoregressive"
    makes_images = True  # responses are image tokens of a fixed count, decoded to the images the reward scores

    def __init__(
        self,
        model: JanusForConditionalGeneration,
        tokenizer,
        *,
        guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
        image_mean: Sequence[float] = (0.5, 0.5, 0.5),
        image_std: Sequence[float] = (0.5, 0.5, 0.5),
        source: str = "",
    ):
        if not guidance_scale >= 1:
            raise ValueError(f"Janus guidance_scale must be >= 1 (1: no guidance); got {guidance_scale}")
        self.model = model
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"
        self.guidance_scale = float(guidance_scale)
        self.image_mean, self.image_std = tuple(image_mean), tuple(image_std)
        self.source = source
        self.dtype = next(model.parameters()).dtype
        self.arch = type(model).__name__
        self.num_image_tokens = int(model.config.vision_config.num_image_tokens)
        gen = model.generation_config
        self.bos_token_id = gen.bos_token_id if gen.bos_token_id is not None else tokenizer.bos_token_id
        self.pad_token_id = gen.pad_token_id if gen.pad_token_id is not None else tokenizer.pad_token_id
        self.boi_token_id = (gen.generation_kwargs or {}).get(
            "boi_token_id", tokenizer.convert_tokens_to_ids("<begin_of_image>")
        )
        self.eos_token_ids: list[int] = []  # an image ends after num_image_tokens tokens, never at an end token

    # ---- what the trainer's shared helpers ask of an adapter ------------------------------------------------
    @property
    def transformer(self) -> nn.Module:
        return self.model

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """The language model's q/k/v/o projections, named in full (the vision encoder has projections too)."""
        return tuple(
            name
            for name, _ in self.model.named_modules()
            if ".language_model." in name and name.rsplit(".", 1)[-1] in ATTENTION_PROJECTIONS
        )

    def denoisers(self) -> list[nn.Module]:
        return [self.model]

    def fsdp_wrap_units(self) -> list[nn.Module]:
        """The language model's decoder layers."""
        return list(self.model.model.language_model.layers)

    def packs(self, images: list[tuple[str, ...]], audios: list[tuple[str, ...]] | None = None) -> bool:
        """Never: an image's tokens replay padded (the trainer asks every token policy, CausalLMPolicy.packs)."""
        return False

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        device="cpu",
        dtype=torch.float32,
        random_weights: bool = False,
        guidance_scale: float | None = None,
    ) -> JanusImagePolicy:
        """Load a local Janus folder (weights from safetensors; random_weights: config.json alone, seeded random
        weights on `device`). guidance_scale None: the folder's generation config's, else Janus-Pro's 5."""
        if not is_janus_folder(path):
            raise ValueError(f"{path!r} is not a Janus folder (config.json with model_type 'janus')")
        if random_weights:
            with seeded(SEED, device), torch.device(device):
                model = JanusForConditionalGeneration._from_config(AutoConfig.from_pretrained(path), dtype=dtype)
            if os.path.isfile(os.path.join(path, "generation_config.json")):
                model.generation_config = GenerationConfig.from_pretrained(path)
        else:
            model = JanusForConditionalGeneration.from_pretrained(path, dtype=dtype, use_safetensors=True)
        model = model.to(device).eval()
        mean = std = (0.5, 0.5, 0.5)  # Janus-Pro's image processor normalises to [-1, 1]
        preprocessor = os.path.join(path, "preprocessor_config.json")
        if os.path.isfile(preprocessor):
            with open(preprocessor) as f:
                settings = json.load(f)
            mean, std = settings.get("image_mean", mean), settings.get("image_std", std)
        if guidance_scale is None:
            guidance_scale = getattr(model.generation_config, "guidance_scale", None) or DEFAULT_GUIDANCE_SCALE
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(model, tokenizer, guidance_scale=guidance_scale, image_mean=mean, image_std=std, source=path)

    # ---- prompts -------------------------------------------------------------------------------------------
    def render(self, prompt: TokenPrompt) -> str:
        """Janus' image-generation turn: BOS, the SFT user/assistant turn (empty system prompt), begin-of-image."""
        if prompt.images or prompt.audios:
            raise ValueError(
                f"{self.source!r}: Janus image generation takes text prompts only; this prompt shows "
                f"{len(prompt.images)} images and plays {len(prompt.audios)} audio clips"
            )
        bos = self.tokenizer.convert_ids_to_tokens(self.bos_token_id)
        boi = self.tokenizer.convert_ids_to_tokens(self.boi_token_id)
        return f"{bos}{USER}: {prompt.text}\n\n{ASSISTANT}:{boi}"

    def encode(self, prompts: list[TokenPrompt]) -> PromptInputs:
        """Token ids of the rendered prompts, left-padded, with their attention mask."""
        enc = self.tokenizer(
            [self.render(p) for p in prompts], return_tensors="pt", padding=True, add_special_tokens=False
        )
        return PromptInputs(enc["input_ids"], enc["attention_mask"])

    def inputs_from_ids(
        self, prompt_ids: list[torch.Tensor], images: list[tuple[str, ...]], audios: list[tuple[str, ...]] | None = None
    ) -> PromptInputs:
        """PromptInputs of stored prompts: their ids left-padded (text only)."""
        if any(images) or any(audios or ()):
            raise ValueError(f"{self.source!r}: Janus image generation takes text prompts only")
        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for i, ids in enumerate(prompt_ids):
            input_ids[i, width - len(ids) :], attention[i, width - len(ids) :] = ids, 1
        return PromptInputs(input_ids, attention)

    def unconditional_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The CFG branch's prompt: every token but BOS and begin-of-image replaced by pad (as transformers does)."""
        keep = (input_ids == self.bos_token_id) | (input_ids == self.boi_token_id)
        return torch.where(keep, input_ids, torch.full_like(input_ids, self.pad_token_id))

    def _cfg_prompt(self, prompts: PromptInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prompt embeddings (2B, P, D), attention mask (2B, P), position ids (2B, P)): cond rows, then uncond."""
        ids = prompts.input_ids.to(self.device)
        both = torch.cat([ids, self.unconditional_ids(ids)])
        mask = prompts.attention_mask.to(self.device).repeat(2, 1)
        embeds = self.model.get_input_embeddings()(both)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        return embeds, mask, positions

    def guided_logits(self, logits_2B: torch.Tensor) -> torch.Tensor:
        """uncond + s (cond - uncond) in fp32, the batch's first half cond, second half uncond."""
        cond, uncond = logits_2B.float().chunk(2)
        return uncond + self.guidance_scale * (cond - uncond)

    # ---- rollout -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, prompts: list[TokenPrompt], params: SamplingParams) -> TokenSamples:
        """params.n images per prompt (rows prompt-major) as image tokens (B, T), the log-probs of the guided,
        temperature-scaled distribution they were drawn from, and the decoded images (TokenSamples.images)."""
        if params.top_p < 1 or params.stop:
            raise ValueError("Janus image sampling takes the full distribution: top_p 1 and no stop strings")
        if params.max_tokens < self.num_image_tokens:
            raise ValueError(
                f"{self.source!r}: an image is {self.num_image_tokens} tokens; set rollout.max_new_tokens to "
                f"{self.num_image_tokens} (got {params.max_tokens})"
            )
        inputs = self.encode(prompts).repeat(params.n)
        was_training = self.model.training
        self.model.eval()
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), _restore_mode(self.model, was_training):
            torch.manual_seed(params.seed)
            tokens, log_probs = self._sample_tokens(inputs, params.temperature)
            images = self.decode(tokens)
        b, t = tokens.shape
        return TokenSamples(
            inputs,
            tokens.cpu(),
            log_probs.cpu(),
            torch.ones((b, t), dtype=torch.bool),
            torch.full((b,), t, dtype=torch.long),
            images=images.cpu(),
        )

    def _sample_tokens(self, inputs: PromptInputs, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(image tokens (B, T), their log-probs (B, T) fp32): T steps of the cond/uncond batch with a KV cache."""
        embeds, mask, positions = self._cfg_prompt(inputs)
        language_model, cache = self.model.model.language_model, DynamicCache()
        tokens, log_probs = [], []
        for _ in range(self.num_image_tokens):
            out = language_model(
                inputs_embeds=embeds, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
            )
            logits = self.guided_logits(self.model.model.generation_head(out.last_hidden_state[:, -1]))
            log_softmax = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
            if temperature == 0:
                token = logits.argmax(-1)
            else:
                token = torch.multinomial(torch.softmax(logits / temperature, dim=-1), num_samples=1).squeeze(-1)
            tokens.append(token)
            log_probs.append(log_softmax.gather(-1, token[:, None]).squeeze(-1))
            embeds = self.model.prepare_embeddings_for_image_generation(torch.cat([token, token])[:, None])
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            positions = positions[:, -1:] + 1
        return torch.stack(tokens, 1), torch.stack(log_probs, 1)

    # ---- replay --------------------------------------------------------------------------------------------
    def log_probs(self, prompts: PromptInputs, response_ids: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
        """(B, T) teacher-forced log-probs of the image tokens (fp32; differentiable when grad is on)."""
        return self.replay(prompts, response_ids, temperature=temperature)[0]

    def replay(
        self, prompts: PromptInputs, response_ids: torch.Tensor, *, temperature: float = 1.0, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs (B, T), entropy (B, T) of the guided distribution or None): one forward of the 2B cond and
        uncond rows over the prompt and the image tokens before each position."""
        response_ids = response_ids.to(self.device)
        b, t = response_ids.shape
        embeds, mask, positions = self._cfg_prompt(prompts)
        image_embeds = self.model.prepare_embeddings_for_image_generation(response_ids[:, :-1].repeat(2, 1))
        p = embeds.shape[1]
        out = self.model.model.language_model(
            inputs_embeds=torch.cat([embeds, image_embeds], dim=1),
            attention_mask=torch.cat([mask, mask.new_ones((2 * b, t - 1))], dim=1),
            position_ids=torch.cat([positions, positions[:, -1:] + torch.arange(1, t, device=self.device)], dim=1),
            use_cache=False,
        )
        hidden = out.last_hidden_state[:, p - 1 :]  # the state that predicts each image token
        logits = self.guided_logits(self.model.model.generation_head(hidden))
        log_softmax = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        picked = log_softmax.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
        if not entropy:
            return picked, None
        with torch.no_grad():  # a metric, never a loss term here
            return picked, -(log_softmax.exp() * log_softmax).sum(-1)

    # ---- decode --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, image_tokens: torch.Tensor) -> torch.Tensor:
        """uint8 images (B, H, W, 3) of image tokens (B, T): the VQ-VAE decoder, then JanusImageProcessor's
        postprocess (x * std + mean, times 255, clipped, truncated to uint8)."""
        pixels = self.model.decode_image_tokens(image_tokens.to(self.device)).float()  # (B, H, W, 3)
        mean = torch.tensor(self.image_mean, device=pixels.device)
        std = torch.tensor(self.image_std, device=pixels.device)
        return ((pixels * std + mean) * 255).clamp(0, 255).to(torch.uint8)

    def responses(self, response_ids: Sequence[torch.Tensor]) -> list[str]:
        """The text a token row keeps as its response: what it is, not the ids (those are response_ids)."""
        return [f"<image: {len(ids)} tokens>" for ids in response_ids]


@contextlib.contextmanager
def _restore_mode(model: nn.Module, training: bool):
    try:
        yield
    finally:
        model.train(training)
