"""The autoregressive policy adapter: a transformers causal LM or VLM read from a local Hugging Face folder -- the
Qwen3-Omni Thinker (``Qwen3OmniMoeThinkerForConditionalGeneration``) or any ``AutoModelForCausalLM`` -- that samples
responses with per-token log-probs and replays them (teacher-forced log-probs, differentiable for the trainer).

Legend: B rows (prompts times samples per prompt), P prompt tokens (left-padded), T response tokens (right-padded).

Log-probs are those of the temperature-scaled distribution, log softmax(logits / temperature), as verl computes
them; top-p truncation is not in them (it changes what is sampled, not the recorded log-prob: the gap is one the
rollout correction sees). Images and audio clips come by reference (file paths in the prompt) and are expanded into
image and audio tokens as ``Qwen3OmniMoeProcessor`` does (audio: 16-bit PCM WAV files,
diffrl/models/causal_lm/audio.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from PIL import Image
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from diffrl.models.causal_lm.audio import audio_features
from diffrl.models.causal_lm.packing import (
    PACKED_SDPA,
    pack,
    supports_packing,
    text_config,
    use_grouped_mm_experts,
    use_packed_sdpa,
)
from diffrl.models.random_weights import SEED, seeded

THINKER_TYPES = ("qwen3_omni_moe_thinker",)
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
TOWERS = ("audio_tower", "visual")  # the Thinker's encoders: not trained by default


@dataclass(frozen=True)
class TokenPrompt:
    """One prompt: its user text, the images it shows and the audio clips it plays (file paths, read when encoded)."""

    text: str
    images: tuple[str, ...] = ()
    audios: tuple[str, ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """How responses are sampled (names as vLLM's SamplingParams).

    n: samples per prompt. max_tokens: new tokens at most. temperature > 0 samples; 0 decodes greedily (its
    log-probs are those of the untempered distribution). top_p in (0, 1].
    stop: strings that end a response (kept in it, as the EOS token is). seed: the sampling RNG seed.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.n and max_tokens must be >= 1; got {self.n}, {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0: greedy); got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1]; got {self.top_p}")


@dataclass
class PromptInputs:
    """Encoded prompts: input_ids, attention_mask (B, P) left-padded, the vision inputs of all their images
    (pixel_values, image_grid_thw, images_per_row (B,)) and the audio inputs of all their clips (input_features
    (N, M, F), feature_attention_mask (N, F), audios_per_row (B,)), clips and images in row order."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    vision: dict[str, torch.Tensor] = field(default_factory=dict)
    audio: dict[str, torch.Tensor] = field(default_factory=dict)

    def repeat(self, n: int) -> PromptInputs:
        """Each prompt n times in a row (its images and clips too), the layout of n samples per prompt."""
        if n == 1:
            return self
        vision, audio = {}, {}
        if self.vision:
            counts = self.vision["images_per_row"]
            patches = self.vision["image_grid_thw"].prod(dim=1)  # rows of pixel_values per image
            patches_per_row = [int(p.sum()) for p in torch.split(patches, counts.tolist())]
            vision = {
                "pixel_values": _repeat_rows(self.vision["pixel_values"], patches_per_row, n),
                "image_grid_thw": _repeat_rows(self.vision["image_grid_thw"], counts.tolist(), n),
                "images_per_row": counts.repeat_interleave(n),
            }
        if self.audio:
            counts = self.audio["audios_per_row"]
            audio = {k: _repeat_rows(v, counts.tolist(), n) for k, v in self.audio.items() if k != "audios_per_row"}
            audio["audios_per_row"] = counts.repeat_interleave(n)
        return PromptInputs(
            self.input_ids.repeat_interleave(n, 0), self.attention_mask.repeat_interleave(n, 0), vision, audio
        )


def _repeat_rows(x: torch.Tensor, sizes: list[int], n: int) -> torch.Tensor:
    """x's leading dim split into one block per prompt (`sizes` entries each), each block n times in a row."""
    blocks = torch.split(x, sizes)
    return torch.cat([block for block in blocks for _ in range(n)])


@dataclass
class TokenSamples:
    """Sampled responses: response_ids, log_probs (temperature-scaled, fp32), mask (B, T), lengths (B,); images: the
    decoded uint8 (B, H, W, 3) of a policy whose responses are image tokens (diffrl/models/janus/policy.py), else
    None."""

    prompts: PromptInputs
    response_ids: torch.Tensor
    log_probs: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    images: torch.Tensor | None = None


class CausalLMPolicy:
    """A causal LM / VLM policy: `model` is the module the trainer updates; `sample` and `log_probs` are the rollout
    and the replay. Loads weights only from safetensors.

    It also answers what the trainer's shared helpers (engines/train/setup.py, checkpoint.py) ask of a model
    adapter: `transformer` (the trained module: here the whole causal LM), `dtype`, `denoisers()`,
    `default_lora_targets` and `fsdp_wrap_units()`, so LoRA, FSDP2 and checkpoints exist once for both families.
    """

    kind = "autoregressive"  # what the step core builds for it (diffusion adapters: "diffusion")

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        image_processor=None,
        feature_extractor: WhisperFeatureExtractor | None = None,
        *,
        source: str = "",
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"
        self.image_processor = image_processor
        self.feature_extractor = feature_extractor
        self.source = source
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.dtype = next(model.parameters()).dtype
        self.arch = type(model).__name__
        # the fastest paths the installed transformers offers: grouped-GEMM experts, packed attention (packing.py)
        self.experts_implementation = use_grouped_mm_experts(model)
        use_packed_sdpa(model)

    @property
    def transformer(self) -> nn.Module:
        """The trained module, under the name the trainer's helpers give a diffusion adapter's denoiser."""
        return self.model

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """The language model's attention projections (q, k, v, o), as verl's LoRA recipes target, named in full:
        the Thinker's audio tower has projections of the same names, which stay frozen."""
        names = [name for name, _ in self.model.named_modules() if name.rsplit(".", 1)[-1] in ATTENTION_PROJECTIONS]
        return tuple(n for n in names if not n.startswith(TOWERS) and ".audio_tower." not in n and ".visual." not in n)

    def denoisers(self) -> list[nn.Module]:
        return [self.model]

    def fsdp_wrap_units(self) -> list[nn.Module]:
        """The decoder layers (FSDP2 shards each, then the whole model)."""
        layers = [
            m for name, m in self.model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)
        ]
        return [layer for module_list in layers for layer in module_list]

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype=torch.float32, random_weights: bool = False):
        """Load a local folder: a Qwen3-Omni Thinker (config model_type qwen3_omni_moe_thinker) or a causal LM.
        random_weights: build the model from config.json alone, random weights made on `device` (a config-only
        folder, diffrl/models/causal_lm/realsize.py; seeded, the same weights on every run)."""
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{path!r} has no config.json: not a Hugging Face model folder")
        with open(os.path.join(path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
        loader = Qwen3OmniMoeThinkerForConditionalGeneration if model_type in THINKER_TYPES else AutoModelForCausalLM
        if random_weights:
            model = _random_model(loader, path, device, dtype)
        else:
            model = loader.from_pretrained(path, dtype=dtype, use_safetensors=True).to(device).eval()
        image_processor = feature_extractor = None
        preprocessor = os.path.join(path, "preprocessor_config.json")
        if os.path.isfile(preprocessor) and model_type in THINKER_TYPES:
            # one file holds both, as in Qwen3-Omni's folders: the image processor's keys and the feature extractor's
            image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
            with open(preprocessor) as f:
                if json.load(f).get("feature_extractor_type") == "WhisperFeatureExtractor":
                    feature_extractor = WhisperFeatureExtractor.from_pretrained(path)
        return cls(model, AutoTokenizer.from_pretrained(path), image_processor, feature_extractor, source=path)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def render(self, prompt: TokenPrompt, image_tokens: Sequence[int], audio_tokens: Sequence[int] = ()) -> str:
        """The chat text of one user turn: each image as <|vision_start|>, its image tokens, <|vision_end|>, then each
        audio clip as <|audio_start|>, its audio tokens, <|audio_end|>, then the text (Qwen3-Omni's template renders
        a turn's items in their order; its model card's examples give the media first)."""
        tok = self.tokenizer
        images = "".join(f"{tok.vision_bos_token}{tok.image_token * n}{tok.vision_eos_token}" for n in image_tokens)
        audios = "".join(f"{tok.audio_bos_token}{tok.audio_token * n}{tok.audio_eos_token}" for n in audio_tokens)
        return f"<|im_start|>user\n{images}{audios}{prompt.text}<|im_end|>\n<|im_start|>assistant\n"

    def chat_template(self) -> str:
        """A Jinja chat template that renders a user turn of OpenAI-style content parts ({"type": "image"},
        {"type": "audio"}, {"type": "text", "text": ...}, as vLLM hands them to a template with
        `--chat-template-content-format openai`) as `render` does, one placeholder token per image and clip: a server
        that expands each placeholder into the item's tokens then tokenizes the prompt `encode` gives. Images first,
        then clips, then the text is the order `render` writes (the parts are rendered in their order)."""
        tok = self.tokenizer
        image = f"{tok.vision_bos_token}{tok.image_token}{tok.vision_eos_token}"
        audio = f"{tok.audio_bos_token}{tok.audio_token}{tok.audio_eos_token}"
        return (
            "{%- for message in messages %}"
            "{{- '<|im_start|>' + message['role'] + '\\n' }}"
            "{%- if message['content'] is string %}{{- message['content'] }}"
            "{%- else %}{%- for part in message['content'] %}"
            f"{{%- if part['type'] == 'image' %}}{{{{- '{image}' }}}}"
            f"{{%- elif part['type'] == 'audio' %}}{{{{- '{audio}' }}}}"
            "{%- else %}{{- part['text'] }}{%- endif %}"
            "{%- endfor %}{%- endif %}"
            "{{- '<|im_end|>\\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
        )

    def encode(self, prompts: list[TokenPrompt]) -> PromptInputs:
        """Tokenize the prompts (left-padded) and preprocess their images and audio clips (inputs concatenated)."""
        vision, per_image = self._vision_inputs([p.images for p in prompts])
        audio, per_clip = self._audio_inputs([p.audios for p in prompts])
        texts, image_start, clip_start = [], 0, 0
        for prompt in prompts:
            images = per_image[image_start : image_start + len(prompt.images)]
            clips = per_clip[clip_start : clip_start + len(prompt.audios)]
            texts.append(self.render(prompt, images, clips))
            image_start, clip_start = image_start + len(prompt.images), clip_start + len(prompt.audios)
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return PromptInputs(enc["input_ids"], enc["attention_mask"], vision, audio)

    def _vision_inputs(self, images: list[tuple[str, ...]]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """(vision inputs of every row's images, image tokens per image); empty when no row shows an image."""
        paths = [p for row in images for p in row]
        if not paths:
            return {}, []
        if self.image_processor is None:
            raise ValueError(f"{self.source!r}: prompts show images but the model folder has no image processor")
        vision = dict(self.image_processor(images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt"))
        vision["images_per_row"] = torch.tensor([len(row) for row in images])
        merge = self.image_processor.merge_size**2
        return vision, (vision["image_grid_thw"].prod(dim=1) // merge).tolist()

    def _audio_inputs(self, audios: list[tuple[str, ...]]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """(audio inputs of every row's clips, audio tokens per clip); empty when no row plays a clip."""
        paths = [p for row in audios for p in row]
        if not paths:
            return {}, []
        if self.feature_extractor is None:
            raise ValueError(
                f"{self.source!r}: prompts play audio but the model folder has no audio feature extractor "
                "(preprocessor_config.json with feature_extractor_type WhisperFeatureExtractor; only a Qwen3-Omni "
                "Thinker takes audio)"
            )
        audio = audio_features(self.feature_extractor, paths, self.model.config.audio_config.n_window)
        tokens = audio.pop("audio_tokens").tolist()
        audio["audios_per_row"] = torch.tensor([len(row) for row in audios])
        return audio, tokens

    def _model_inputs(self, prompts: PromptInputs) -> dict[str, torch.Tensor]:
        """The forward's inputs besides the attention mask: the ids, the images' and the clips' inputs."""
        extra = {**prompts.vision, **prompts.audio}
        extra = {k: v.to(self.device) for k, v in extra.items() if k not in ("images_per_row", "audios_per_row")}
        if "input_features" in extra:  # the audio tower runs in the model's dtype, as the image tower does
            extra["input_features"] = extra["input_features"].to(self.dtype)
        return {"input_ids": prompts.input_ids.to(self.device), **extra}

    @torch.no_grad()
    def sample(self, prompts: list[TokenPrompt], params: SamplingParams) -> TokenSamples:
        """n responses per prompt (rows prompt-major), with the per-token log-probs of the sampling distribution."""
        inputs = self.encode(prompts).repeat(params.n)
        greedy = params.temperature == 0
        sampling = {} if greedy else {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        # generate in eval mode: in train mode transformers drops the KV cache under gradient checkpointing, and its
        # cache-less decoding of left-padded prompts gave log-probs 0.18 off the replay (tiny Thinker)
        was_training = self.model.training
        self.model.eval()
        with (
            torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []),
            _restore_mode(self.model, was_training),
        ):
            torch.manual_seed(params.seed)
            out = self.model.generate(
                **self._model_inputs(inputs),
                attention_mask=inputs.attention_mask.to(self.device),
                do_sample=not greedy,
                **sampling,
                max_new_tokens=params.max_tokens,
                stop_strings=list(params.stop) or None,
                tokenizer=self.tokenizer if params.stop else None,
                eos_token_id=self.eos_token_ids,
                pad_token_id=self.tokenizer.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
        response = out.sequences[:, inputs.input_ids.shape[1] :]
        # one generated position at a time: the (B, T, V) logits in fp32 at once were 37 GiB for 64 x 1024 tokens of
        # the 30B-A3B Thinker's 152k vocabulary (out of memory on an H200); each position's fp32 log-softmax is B x V
        temperature = params.temperature or 1.0
        log_probs = torch.stack(
            [
                torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, response[:, t, None]).squeeze(-1)
                for t, logits in enumerate(out.logits)
            ],
            dim=1,
        )
        del out
        lengths = self.response_lengths(response, params.stop)
        mask = torch.arange(response.shape[1], device=response.device)[None, :] < lengths[:, None].to(response.device)
        return TokenSamples(inputs, response.cpu(), (log_probs * mask).cpu(), mask.cpu(), lengths)

    def response_lengths(self, response: torch.Tensor, stop: tuple[str, ...] = ()) -> torch.Tensor:
        """(B,) tokens up to and including the first EOS token or the token that completes a stop string; what
        generate appends after that is padding."""
        lengths = []
        for row in response.tolist():
            length = len(row)
            for t, token in enumerate(row):
                if token in self.eos_token_ids:
                    length = t + 1
                    break
            if stop:
                for t in range(length):
                    if any(s in self.tokenizer.decode(row[: t + 1]) for s in stop):
                        length = t + 1
                        break
            lengths.append(length)
        return torch.tensor(lengths)

    def inputs_from_ids(
        self,
        prompt_ids: list[torch.Tensor],
        images: list[tuple[str, ...]],
        audios: list[tuple[str, ...]] | None = None,
    ) -> PromptInputs:
        """PromptInputs of stored prompts: their token ids left-padded, their images and audio clips (by path)
        preprocessed again."""
        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for i, ids in enumerate(prompt_ids):
            input_ids[i, width - len(ids) :], attention[i, width - len(ids) :] = ids, 1
        audio, tokens = self._audio_inputs(audios or [() for _ in prompt_ids])
        placed = 0
        if audio:
            placed = int((input_ids == self.tokenizer.convert_tokens_to_ids(self.tokenizer.audio_token)).sum())
        if placed != sum(tokens):  # the stored ids were rendered for other features (another extractor or file)
            raise ValueError(
                f"{self.source!r}: the stored prompts hold {placed} audio tokens, their clips give {sum(tokens)} now; "
                "an audio file or the feature extractor changed since the rows were sampled"
            )
        return PromptInputs(input_ids, attention, self._vision_inputs(images)[0], audio)

    def log_probs(self, prompts: PromptInputs, response_ids: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
        """(B, T) teacher-forced log-probs of the responses (fp32; differentiable when grad is on): the replay."""
        return self.replay(prompts, response_ids, temperature=temperature)[0]

    def replay(
        self, prompts: PromptInputs, response_ids: torch.Tensor, *, temperature: float = 1.0, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs (B, T), entropy (B, T) of the temperature-scaled distribution or None): one forward."""
        response_ids = response_ids.to(self.device)
        inputs = self._model_inputs(prompts)
        prompt_len = prompts.input_ids.shape[1]
        inputs["input_ids"] = torch.cat([inputs["input_ids"], response_ids], dim=1)
        # generate attends to every generated token; the padding after a response's end affects no earlier token
        attention = torch.cat([prompts.attention_mask.to(self.device), torch.ones_like(response_ids)], dim=1)
        logits = self.model(**inputs, attention_mask=attention).logits[:, prompt_len - 1 : -1]
        return _picked_log_probs(logits, response_ids, temperature, entropy)

    def packs(self, images: list[tuple[str, ...]], audios: list[tuple[str, ...]] | None = None) -> bool:
        """Whether `replay_packed` runs these prompts: a model whose forward reads packed sequences
        (diffrl/models/causal_lm/packing.py) and prompts without images or audio; others replay padded."""
        return supports_packing(self.model) and not any(images) and not any(audios or ())

    def replay_packed(
        self,
        prompt_ids: list[torch.Tensor],
        response_ids: list[torch.Tensor],
        *,
        temperature: float = 1.0,
        entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`replay` of text-only prompts (ragged ids, no padding) as one packed row: (log-probs (b, T), entropy (b, T)
        or None), T the longest response, 0 past each response's end. The lm_head runs on the response positions
        only."""
        packed = pack(prompt_ids, response_ids)
        extra = {}
        if text_config(self.model)._attn_implementation == PACKED_SDPA:
            extra["segment_lengths"] = packed.segment_lengths
        hidden = self.model.model(
            input_ids=packed.input_ids.to(self.device),
            position_ids=packed.position_ids.to(self.device),
            use_cache=False,
            **extra,
        ).last_hidden_state  # (1, N, hidden)
        logits = self.model.lm_head(hidden[0, packed.logit_index.to(self.device)])  # (b, T, V)
        ids = torch.zeros(packed.mask.shape, dtype=torch.long)
        for i, r in enumerate(response_ids):
            ids[i, : len(r)] = r
        mask = packed.mask.to(self.device)
        picked, ent = _picked_log_probs(logits, ids.to(self.device), temperature, entropy)
        return picked * mask, None if ent is None else ent * mask


def _picked_log_probs(
    logits: torch.Tensor, response_ids: torch.Tensor, temperature: float, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs (B, T) of the response tokens under softmax(logits / temperature), in fp32; its entropy or None)."""
    log_softmax = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)
    picked = log_softmax.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return picked, None
    with torch.no_grad():  # a metric (verl's actor/entropy), never a loss term here
        return picked, -(log_softmax.exp() * log_softmax).sum(-1)


@contextlib.contextmanager
def _restore_mode(model: nn.Module, training: bool):
    try:
        yield
    finally:
        model.train(training)


def _random_model(loader, path: str, device, dtype) -> nn.Module:
    """The model of `path`'s config.json with random weights, built on `device` in `dtype`."""
    config = AutoConfig.from_pretrained(path)
    with seeded(SEED, device), torch.device(device):  # the same weights in every process, as a diffusion random: path
        if loader is AutoModelForCausalLM:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = loader._from_config(config, dtype=dtype)
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def _eos_ids(model: nn.Module, tokenizer) -> list[int]:
    """The ids that end a response: the generation config's EOS ids, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos)
