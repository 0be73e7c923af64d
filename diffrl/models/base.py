"""The model-adapter contract and the architecture registry.

An adapter wraps one diffusers pipeline folder and exposes exactly what the rollout engine and the
trainer need, mirroring the upstream pipeline's numerics (prompt templates, sigma schedule, initial
noise, guidance, decoding). Algorithms never see an adapter; adapters never name an algorithm.

Legend: B batch, L text tokens, D text hidden size, N denoising steps.
Latents are in the adapter's own layout (SD3: (B, C, H, W); Qwen-Image/FLUX: packed (B, L, C);
Wan: (B, C, F, H, W)); the engines treat them as opaque fp32 tensors with a fixed per-sample shape.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib
import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from PIL import Image
from torch import nn

from diffrl import registry
from diffrl.models.kind import RANDOM, is_bagel_folder, is_hunyuan_image3_folder
from diffrl.models.offload import HostResident, all_on

# A prompt encoding: batch-first tensors under the names the transformer takes, e.g.
# {"prompt_embeds": (B, L, D), "pooled_prompt_embeds": (B, D)} or {"prompt_embeds", "prompt_embeds_mask"}.
Encoding = dict[str, torch.Tensor]


def register_adapter(cls: type["ModelAdapter"]) -> type["ModelAdapter"]:
    """Class decorator: make an adapter findable by its `arch` name and pipeline class names (diffrl.registry)."""
    return registry.register("model", cls.arch)(cls)


def supported_architectures() -> dict[str, tuple[str, ...]]:
    """arch name -> the model_index.json `_class_name` values it handles."""
    return {name: registry.get("model", name).obj.pipeline_classes for name in registry.names("model")}


def adapter_class(arch: str) -> type["ModelAdapter"]:
    """The adapter class for an arch name (e.g. "sd3"); ValueError listing the choices otherwise."""
    return registry.get("model", arch).obj


def detect_architecture(path: str) -> str:
    """Read `model_index.json` in a diffusers folder and return the arch name that handles it."""
    index_path = os.path.join(path, "model_index.json")
    if not os.path.isdir(path):
        raise ValueError(f"model path {path!r} is not a directory (expected a diffusers pipeline folder)")
    if is_bagel_folder(path):  # no model_index.json: BAGEL's own layout (diffrl/models/bagel/layout.py)
        return "bagel"
    if is_hunyuan_image3_folder(path):  # config.json, not model_index.json (diffrl/models/hunyuan_image3/layout.py)
        return "hunyuan_image3"
    if not os.path.isfile(index_path):
        raise ValueError(f"{path!r} has no model_index.json: not a diffusers pipeline folder")
    with open(index_path) as f:
        class_name = json.load(f).get("_class_name")
    # the adapter modules of the architecture folders (diffrl/models/__init__.py), in order, imported only as far as
    # the one that handles it: each pulls in its diffusers pipeline, which costs seconds of import time
    for module in registry.builtin_modules("model"):
        importlib.import_module(module)
        for arch, entry in registry.registered("model").items():
            if class_name in entry.obj.pipeline_classes:
                return arch
    known = sorted(c for classes in supported_architectures().values() for c in classes)
    raise ValueError(f"{index_path}: pipeline class {class_name!r} is not supported; supported: {known}")


# Set while load_adapter loads with offload_text_encoder: load_pipeline then leaves the text encoders on the host.
_TEXT_ENCODERS_ON_HOST = contextvars.ContextVar("text_encoders_on_host", default=False)


def is_text_encoder(name: str) -> bool:
    """A pipeline component that encodes prompts (diffusers names them text_encoder, text_encoder_2, ...)."""
    return name.startswith("text_encoder")


def load_adapter(
    path: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    offload_text_encoder: bool = False,
    **kwargs,
) -> "ModelAdapter":
    """Detect the architecture of a diffusers folder and load its adapter. `random:<folder>`: a folder of configs
    only, built with random weights (diffrl/models/random_weights.py). `offload_text_encoder`: the text encoders
    never load onto `device`; they wait in host memory and visit it only to encode (ModelAdapter.offload_text_encoders).
    """
    arch = detect_architecture(path.removeprefix(RANDOM))
    token = _TEXT_ENCODERS_ON_HOST.set(offload_text_encoder)
    try:
        adapter = adapter_class(arch).from_pretrained(path, device=device, dtype=dtype, **kwargs)
    finally:
        _TEXT_ENCODERS_ON_HOST.reset(token)
    if offload_text_encoder:
        adapter.offload_text_encoders()
    return adapter


_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def load_pipeline(pipeline_cls, path: str, *, device, dtype: torch.dtype, components: dict | None = None):
    """`pipeline_cls.from_pretrained(path, dtype=dtype)` (diffusers' new name of torch_dtype) moved to device, or
    for `random:<folder>` the folder's configs built with random weights on `device`; a clear ValueError when the
    folder is missing (a string shaped like "owner/name" that is no local folder is tried on the Hub).
    `components`: pipeline components built by the adapter instead of loaded (Qwen-Image-Edit's processor)."""
    random_weights, folder = path.startswith(RANDOM), path.removeprefix(RANDOM)
    if not os.path.isdir(folder) and (random_weights or not _HUB_ID.match(path)):
        raise ValueError(f"model path {path!r} does not exist (expected a diffusers {pipeline_cls.__name__} folder)")
    on_host = _TEXT_ENCODERS_ON_HOST.get()
    if random_weights:
        from diffrl.models.random_weights import random_pipeline

        pipe = random_pipeline(
            pipeline_cls,
            folder,
            device=device,
            dtype=dtype,
            components=components,
            host=is_text_encoder if on_host else None,
        )
    else:
        try:
            pipe = pipeline_cls.from_pretrained(path, dtype=dtype, **(components or {}))
        except OSError as err:  # diffusers raises OSError for a missing or incomplete folder / Hub id
            raise ValueError(f"could not load a {pipeline_cls.__name__} from {path!r}: {err}") from err
    pipe.set_progress_bar_config(disable=True)
    if on_host:  # the text encoders stay where they loaded, on the host
        for name, module in pipe.components.items():
            if isinstance(module, nn.Module) and not is_text_encoder(name):
                module.to(device)
    else:
        pipe = pipe.to(device)
    vae = getattr(pipe, "vae", None)
    if torch.device(device).type == "cpu" and vae is not None and all(p.dim() <= 4 for p in vae.parameters()):
        # CPU convolutions run about 2x faster on NHWC weights (the shapes-small VAE decodes 48 images in
        # 0.29 s against 0.63 s on the 2-core CPU); the outputs differ from NCHW by float rounding only. Video
        # VAEs (Qwen-Image's, Wan's: 3D convolutions) stay as they are.
        vae.to(memory_format=torch.channels_last)
    return pipe


def pad_and_cat(encodings: list[Encoding]) -> Encoding:
    """Concatenate per-prompt encodings along the batch, right-padding the token dim (dim 1) with zeros.

    Masks (keys ending in "mask") are padded with 0 too, so padded tokens stay masked out.
    """
    out: Encoding = {}
    for key in encodings[0]:
        parts = [e[key] for e in encodings]
        if parts[0].dim() >= 2 and len({p.shape[1] for p in parts}) > 1:
            longest = max(p.shape[1] for p in parts)
            parts = [_pad_dim1(p, longest) for p in parts]
        out[key] = torch.cat(parts, dim=0)
    return out


def text_bucket(tokens: int) -> int:
    """The text length compiled denoiser blocks see for a batch whose longest prompt has `tokens` tokens: the next
    multiple of 32 up to 128 tokens, of 128 above. Compiled blocks specialise on the text length: without buckets a
    new length recompiles them (at real size a second full compile in a run's second step: 63-82 s against 14-18 s
    for Qwen-Image on one H200), and from the second length on torch.compile makes the length a dynamic dimension.
    Buckets keep the shapes few and static (see `ModelAdapter.compile_blocks`)."""
    if tokens < 1:
        raise ValueError(f"a prompt encoding has at least one token; got {tokens}")
    step = 32 if tokens <= 128 else 128
    return -(-tokens // step) * step


def pad_tokens(encoding: Encoding, keys: tuple[str, ...], length: int) -> Encoding:
    """`encoding` with the token dim (dim 1) of each of `keys` right-padded with zeros to `length` (a mask's zeros keep
    the padded tokens masked out); the other entries are shared, not copied."""
    out = dict(encoding)
    for key in keys:
        value = encoding[key]
        if value.shape[1] > length:
            raise ValueError(f"{key} has {value.shape[1]} tokens, more than the {length} to pad to")
        out[key] = _pad_dim1(value, length)
    return out


def _pad_dim1(value: torch.Tensor, length: int) -> torch.Tensor:
    """`value` right-padded with zeros along dim 1 (the token dim) to `length` (itself when already that long)."""
    if value.shape[1] == length:
        return value
    return torch.nn.functional.pad(value, (0, 0) * (value.dim() - 2) + (0, length - value.shape[1]))


def select(encoding: Encoding, index: torch.Tensor | slice | list[int]) -> Encoding:
    """Rows of an encoding (same index applied to every tensor)."""
    return {k: v[index] for k, v in encoding.items()}


def check_image_shape(shape: SampleShape, multiple: int, model: str, why: str) -> None:
    """ValueError unless `shape` is one frame whose height and width are positive multiples of `multiple`; `why`
    says where the multiple comes from (e.g. "VAE scale factor 8 x 2x2 latent packing")."""
    if shape.num_frames != 1:
        raise ValueError(f"num_frames must be 1 for the image model {model}, got {shape.num_frames}")
    for name, value in (("height", shape.height), ("width", shape.width)):
        if value <= 0 or value % multiple:
            raise ValueError(f"{name}={value} must be a positive multiple of {multiple} ({why})")


def load_image(image: str | Image.Image) -> Image.Image:
    """An RGB PIL image from a path or a PIL image (an editing model's input); ValueError naming the path when it
    cannot be read."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    try:
        with Image.open(image) as opened:
            return opened.convert("RGB")
    except (OSError, ValueError) as err:
        raise ValueError(f"input image {image!r} cannot be read as an image: {err}") from None


def check_input_images(arch: str, prompts: list[str], images: list | None) -> None:
    """ValueError unless an editing adapter got one input image per prompt."""
    if images is None or len(images) != len(prompts):
        given = "none" if images is None else len(images)
        raise ValueError(
            f"{arch} edits an input image: give one image per prompt ({len(prompts)} prompts, {given} images); in a "
            "prompt file, an 'image' column"
        )


def by_image_grid(
    latents: torch.Tensor, encoding: Encoding, run: Callable[[torch.Tensor, tuple[int, int]], torch.Tensor]
) -> torch.Tensor:
    """An editing adapter's velocity (B, ...) fp32 computed per input-image grid: `run(rows, grid)` returns the
    velocity of the samples `rows` (a (b,) index tensor), whose input images all have the token grid `grid` (the
    encoding's "image_grid" row), in one forward. Reading the grids is one device-to-host copy per call."""
    grids = [tuple(g) for g in encoding["image_grid"].tolist()]
    if len(set(grids)) == 1:  # the usual case: one forward for the whole batch
        return run(torch.arange(len(grids), device=latents.device), grids[0])
    out = torch.empty(latents.shape, dtype=torch.float32, device=latents.device)
    for grid in dict.fromkeys(grids):
        rows = torch.tensor([i for i, g in enumerate(grids) if g == grid], device=latents.device)
        out[rows] = run(rows, grid)
    return out


def images_to_uint8(images_B3HW: torch.Tensor) -> torch.Tensor:
    """Postprocessed images in [0, 1] (B, 3, H, W) -> uint8 (B, H, W, 3) on the host, rounded exactly
    as the pipelines' "np" output then `numpy_to_pil` round them (fp32 x 255, half-to-even). Done on
    the images' device so only uint8 crosses to the host."""
    return (images_B3HW.permute(0, 2, 3, 1).float() * 255).round().to(torch.uint8).cpu()


@dataclass(frozen=True)
class SampleShape:
    """Resolution of one generated sample; num_frames is 1 for images. duration: seconds of audio an audio-only model
    makes (None: the model's default); image and video models ignore it."""

    height: int
    width: int
    num_frames: int = 1
    duration: float | None = None


ATTENTION_BACKENDS = ("default", "cudnn", "flash", "efficient", "math")


def attention_context(backend: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The scaled-dot-product-attention backend for the denoiser forwards (`model.attention`).

    "default" leaves PyTorch's own choice (what diffusers' pipelines get). "cudnn" / "flash" /
    "efficient" / "math" put that backend first on CUDA (PyTorch falls back to the others when it
    cannot take the inputs); on CPU every setting is PyTorch's own choice. Measured on an H200 for
    SD3.5-Medium sampling, cuDNN first and the default ran at the same speed (5.115 vs 5.121 images/s,
    benchmarks/results/sampler_vs_diffusers_nvidia_h200.json), so the default stays. The backward
    reuses the kernel family the forward chose, so only forwards need the context.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {backend!r}")
    if backend == "default" or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    first = order.pop(backend)
    return sdpa_kernel([first, *order.values()], set_priority=True)


def set_tf32(enabled: bool) -> None:
    """Let CUDA fp32 matmuls and convolutions run on TF32 tensor cores (`model.tf32`); process-wide.

    Over a bf16 base the fp32 LoRA branches are such matmuls (peft computes them in the LoRA weights'
    dtype): in full fp32 they run on the GPU's plain fp32 units, several times slower than TF32. The
    rollout and the trainer share the process setting, so the rollout/replay log-prob gap stays that of
    shared numerics. No effect on CPU. Uses PyTorch's `allow_tf32` flags (mixing them with the newer
    `fp32_precision` API is an error in PyTorch >= 2.9: set TF32 in one way only).
    """
    torch.backends.cuda.matmul.allow_tf32 = bool(enabled)
    torch.backends.cudnn.allow_tf32 = bool(enabled)


class DiffusersLoraWriter:
    """`save_lora_weights` for a pipeline class diffusers gives no LoRA writer (BAGEL, Stable Audio 3): mixed into the
    pipeline class, it writes the file as diffusers' own writers do, so checkpoints and `diffrl export` read it
    alike."""

    @classmethod
    def save_lora_weights(
        cls,
        save_directory: str,
        *,
        transformer_lora_layers: dict[str, torch.Tensor],
        transformer_lora_adapter_metadata: dict | None = None,
        weight_name: str = "pytorch_lora_weights.safetensors",
    ) -> None:
        """Write a LoRA as diffusers writes one: `transformer.<module>.lora_A.weight` keys, the LoraConfig under the
        metadata key `lora_adapter_metadata` (what `load_lora_adapter(..., prefix="transformer")` reads back)."""
        from safetensors.torch import save_file

        os.makedirs(save_directory, exist_ok=True)
        tensors = {f"transformer.{k}": v.detach().contiguous().cpu() for k, v in transformer_lora_layers.items()}
        metadata = {"format": "pt"}
        if transformer_lora_adapter_metadata is not None:
            metadata["lora_adapter_metadata"] = json.dumps(
                {f"transformer.{k}": v for k, v in transformer_lora_adapter_metadata.items()}, default=list
            )
        save_file(tensors, os.path.join(save_directory, weight_name), metadata=metadata)


class ModelAdapter(ABC):
    """One architecture. Subclasses live in their architecture's folder (diffrl/models/sd3/adapter.py, ...), decorated
    with @register_adapter, and must reproduce the upstream diffusers pipeline exactly at noise level 0."""

    arch: ClassVar[str]  # registry name, e.g. "sd3"
    pipeline_classes: ClassVar[tuple[str, ...]]  # model_index.json _class_name values handled
    is_video: ClassVar[bool] = False
    # Audio: decode_audio() gives each sample's waveform at `audio_sample_rate` Hz (the rewards get an AudioBatch).
    has_audio: ClassVar[bool] = False
    # False for an audio-only generator: it has no frames to decode, and none are stored.
    visual: ClassVar[bool] = True
    audio_sample_rate: int  # Hz of decode_audio's waveform (audio adapters: an instance attribute or property)
    fps: float = 16.0  # frames per second of decode's videos (Wan's export rate); a video adapter may set its own
    # Editing models: each prompt comes with an input image (metadata["image"]), passed to encode_prompt(images=).
    input_image: ClassVar[bool] = False
    # Takes a last frame too where a prompt row has one (metadata["last_image"], encode_prompt(last_images=)).
    last_image: ClassVar[bool] = False
    # The input image's condition is made at the sample's size: encode_prompt(shape=) and the cache key carry it.
    condition_on_shape: ClassVar[bool] = False
    default_lora_targets: ClassVar[tuple[str, ...]]  # peft target_modules names in the transformer
    default_guidance_scale: ClassVar[float]
    default_max_sequence_length: ClassVar[int]

    def __init__(self, pipe, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.pipe = pipe
        self.device = torch.device(device)
        self.dtype = dtype
        self.source = ""  # path or hub id it was loaded from (set by from_pretrained)
        self.attention = "default"  # SDPA backend of the denoiser forwards (see attention_context)
        self.compiled = False  # compile_blocks ran: adapters whose text length varies pad it to text_bucket()
        self.host_resident: list[HostResident] = []  # offloaded text encoders (offload_text_encoders)

    def attention_context(self) -> contextlib.AbstractContextManager:
        """Enter around denoiser forwards: selects the SDPA backend `self.attention` names."""
        return attention_context(self.attention, self.device)

    # ---- text encoders in host memory ---------------------------------------------------------------
    def offload_text_encoders(self) -> list[HostResident]:
        """Keep the pipeline's text encoders in host memory; encode_prompt runs inside text_encoders_on_device().
        ValueError for a model whose prompts go through the denoiser itself (BAGEL, HunyuanImage-3.0)."""
        if not self.host_resident:
            named = [
                (name, module)
                for name, module in getattr(self.pipe, "components", {}).items()
                if is_text_encoder(name) and isinstance(module, nn.Module)
            ]
            if not named:
                raise ValueError(
                    f"model.offload_text_encoder: {self.arch} has no separate text encoder to keep off the GPU "
                    "(its denoiser reads the prompt); set it to false"
                )
            self.host_resident = [HostResident(name, module.requires_grad_(False)) for name, module in named]
        return self.host_resident

    def text_encoders_on_device(self) -> contextlib.AbstractContextManager:
        """Enter around encode_prompt: offloaded text encoders visit the adapter's device inside the block."""
        return all_on(self.host_resident, self.device) if self.host_resident else contextlib.nullcontext()

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype=torch.float32, **kwargs) -> "ModelAdapter":
        """Load the pipeline components from a diffusers folder (or a Hub id when online)."""

    @property
    def transformer(self) -> nn.Module:
        """The denoiser the trainer updates (peft wraps it in place)."""
        return self.pipe.transformer

    def denoisers(self) -> list[nn.Module]:
        """Every denoiser module (Wan2.2 has two experts); trainers and weight sync iterate these."""
        return [self.transformer]

    def fsdp_wrap_units(self) -> list[nn.Module]:
        """Submodules to `fully_shard` individually (the transformer blocks), before the root."""
        blocks = getattr(self.transformer, "transformer_blocks", None)
        return list(blocks) if blocks is not None else []

    def compile_blocks(self, **options) -> int:
        """torch.compile each transformer block in place (regional compilation: the blocks are the same
        code, so they compile once and reuse it); `options` go to torch.compile. Returns how many blocks.

        The denoiser's first forward after this compiles (19-70 s measured at real size on an H200); LoRA
        added later or a new batch shape recompiles once. `model.compile: true` calls this after the
        trainer is built. Shapes stay static (`dynamic=False` unless `options` say otherwise): each new shape
        (rollout batch, training micro-batch, a text bucket) compiles its own graph once, as the benchmarks
        measure them, instead of torch.compile turning a dimension dynamic when it sees its second value. Adapters
        whose prompts vary in length pad them to `text_bucket` lengths once compiled, which keeps those shapes few.
        """
        import torch._dynamo

        units = self.fsdp_wrap_units()
        if not units:
            raise ValueError(f"{self.arch}: {type(self.transformer).__name__} has no transformer blocks to compile")
        # Rollout (CFG batch), training (micro-batch) and grad/no-grad modes each specialise: allow them all.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        options.setdefault("dynamic", False)
        for unit in units:
            unit.compile(**options)
        self.compiled = True
        return len(units)

    def fingerprint(self) -> str:
        """Stable id of the text-encoding side (for the prompt-embedding cache key)."""
        return hashlib.sha1(f"{self.arch}:{os.path.abspath(self.source)}".encode()).hexdigest()[:16]

    # ---- the sampling contract -----------------------------------------------------------------
    @abstractmethod
    def check_shape(self, shape: SampleShape) -> None:
        """ValueError naming height/width/num_frames when they do not fit the VAE and patch size."""

    @abstractmethod
    def encode_prompt(self, prompts: list[str], *, max_sequence_length: int | None = None) -> Encoding:
        """Encode prompts exactly as the upstream pipeline's `encode_prompt` (templates, dropped
        template tokens, padding); batch-first tensors, on self.device. Warns when truncating."""

    def needs_negative(self, guidance_scale: float) -> bool:
        """Whether velocity() needs a negative-prompt encoding at this guidance scale (CFG-style)."""
        return guidance_scale > 1.0

    def uses_cfg(self, guidance_scale: float, negative: Encoding | None) -> bool:
        """needs_negative(guidance_scale), for velocity(): ValueError when CFG is on and `negative` is missing."""
        cfg = self.needs_negative(guidance_scale)
        if cfg and negative is None:
            raise ValueError(f"guidance_scale={guidance_scale} > 1 needs a negative-prompt encoding (negative=None)")
        return cfg

    @abstractmethod
    def sigmas(self, num_inference_steps: int, shape: SampleShape) -> torch.Tensor:
        """(N + 1,) fp32 sigma schedule the upstream pipeline uses (same shift / mu), ending in 0."""

    @abstractmethod
    def prepare_latents(self, shape: SampleShape, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial noise (B, ...) fp32, one generator per sample, drawn exactly as upstream draws it
        for a batch of one with that generator."""

    @abstractmethod
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
        """Guided velocity (B, ...) fp32 at per-sample sigmas (B,), guidance applied as upstream
        (cond and uncond in one forward where shapes allow). Differentiable w.r.t. the transformer."""

    @abstractmethod
    def decode(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """Final latents -> uint8 images (B, H, W, 3) or videos (B, F, H, W, 3), as upstream's
        postprocess would produce them (pil/np output rounded the same way)."""

    def decode_audio(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """Final latents -> float32 waveform (B, C, T) in [-1, 1] on the host, as the upstream pipeline's audio output
        (its vocoder / audio VAE) with the same rounding as its "np"/"pt" output. Adapters with has_audio only."""
        raise NotImplementedError(f"{self.arch} makes no audio (has_audio is False)")
