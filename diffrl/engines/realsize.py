"""Real-size random-weight pipeline folders (`diffrl random-model`): SD3.5-Medium, Qwen-Image, Wan2.2 T2V A14B.

Every component is built from the published config (numbers below, each with its source), so a folder
has the real checkpoint's shapes and costs the real compute, but holds random weights. It loads with
`DiffusionPipeline.from_pretrained` and `models.base.load_adapter` like the real folder, offline.
Tokenizers are built in memory (diffrl/models/tiny/tokenizers.py, and a Qwen byte-level BPE trained on the
prompt generators' text) with the real special tokens; every token id stays below the real vocab size.

Writing: the parameter count of each component is taken on the meta device first and checked against
the free disk space; then ONE component at a time is initialised on `device` in `dtype` by the modules'
own init (transformers' `_init_weights` for the text encoders, PyTorch's layer defaults for the diffusers
models), saved as sharded safetensors and freed. The folder is written as OUT_DIR.tmp and renamed at the
end, model_index.json last, so a half-written folder never loads. Checked in bf16 on the CPU with this
init: the real-size SD3.5-M transformer, T5-XXL, both CLIPs and both VAEs give finite outputs (std 0.2-1);
Qwen2.5-VL's residual stream grows slowly (std 5.7 after 5 of its 28 layers, finite); the Qwen-Image
blocks (6 of 60 at real width) keep std ~0.58.

`weights=False` (`--configs-only`) writes the same folder without weight files: `model.path: random:<folder>` then
builds every model component from its config with random weights in memory on the run's device
(diffrl/models/random_weights.py), which Qwen-Image needs on a 64 GB disk.

Wan2.2 A14B's plan and its published numbers are in diffrl/engines/realsize_wan.py (~69 GB in bf16: configs only on
a 64 GB disk); the helpers here are shared.

`scale` (tests only) maps a component's folder name to config overrides (nested dicts merge), e.g.
{"transformer": {"num_layers": 2}}: the same code path at toy size.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from diffrl.models.random_weights import default_dtype, seeded

ARCHITECTURES = ("sd35m", "qwen_image", "wan22_a14b")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_SHARD_SIZE = "5GB"
# Tokenizers, configs and safetensors headers, on top of parameters x bytes.
DISK_MARGIN_BYTES = 256 * 2**20
_MARKER = ".diffrl-random-model-incomplete"

# ---- stabilityai/stable-diffusion-3.5-medium ------------------------------------------------------
# transformer/config.json; equal to benchmarks/trainer_fsdp.py SD35_MEDIUM (MMDiT-X: dual attention in
# blocks 0-12, RMS q/k norm, 384x384 positional-embedding table).
SD35M_TRANSFORMER = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
# vae/config.json; equal to benchmarks/common.py SD3_VAE.
SD35M_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    act_fn="silu",
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=1.5305,
    shift_factor=0.0609,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
# scheduler/scheduler_config.json; equal to benchmarks/common.py SD3_SCHEDULER.
SD35M_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)
# text_encoder: OpenAI CLIP ViT-L/14 text tower with projection. The config.json published with the SD3 /
# FLUX.1 / SDXL diffusers folders (e.g. black-forest-labs/FLUX.1-schnell text_encoder/config.json):
# 12 layers, width 768, MLP 3072, 12 heads, quick_gelu, 77 positions, vocab 49408, projection 768.
CLIP_L_TEXT = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    projection_dim=768,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    initializer_range=0.02,
    initializer_factor=1.0,
)
# text_encoder_2: OpenCLIP ViT-bigG/14 text tower with projection (the SDXL text_encoder_2/config.json,
# which SD3 reuses): 32 layers, width 1280, MLP 5120, 20 heads, gelu, projection 1280.
CLIP_BIGG_TEXT = dict(
    vocab_size=49408,
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    max_position_embeddings=77,
    projection_dim=1280,
    hidden_act="gelu",
    layer_norm_eps=1e-5,
    initializer_range=0.02,
    initializer_factor=1.0,
)
# text_encoder_3: google/t5-v1_1-xxl encoder (black-forest-labs/FLUX.1-schnell text_encoder_2/config.json,
# the same T5EncoderModel SD3 ships): d_model 4096, d_ff 10240 gated-gelu, 24 layers, 64 heads of 64,
# 32 relative-position buckets up to distance 128, vocab 32128.
T5_XXL_ENCODER = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
    initializer_factor=1.0,
    is_encoder_decoder=False,
    tie_word_embeddings=False,
)

# ---- Qwen/Qwen-Image ------------------------------------------------------------------------------
# transformer/config.json; equal to benchmarks/trainer_fsdp.py QWEN_IMAGE.
QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)
# vae/config.json equals AutoencoderKLQwenImage's defaults (base_dim 96, z_dim 16), as benchmarks/common.py notes.
QWEN_IMAGE_VAE: dict = {}
# scheduler/scheduler_config.json; equal to benchmarks/common.py QWEN_SCHEDULER.
QWEN_IMAGE_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)
# text_encoder: Qwen2.5-VL-7B-Instruct, vision tower included. Qwen/Qwen-Image text_encoder/config.json
# (transformers 4.53.1), as reproduced in aigc-apps/VideoX-Fun comfyui/qwenimage/nodes.py; the same numbers
# as Qwen/Qwen2.5-VL-7B-Instruct config.json. Token ids of the tokenizer-dependent fields are ours (below).
QWEN25_VL_7B = dict(
    text_config=dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        hidden_act="silu",
        max_position_embeddings=128000,
        max_window_layers=28,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        attention_dropout=0.0,
        use_sliding_window=False,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[16, 24, 24]),
    ),
    vision_config=dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        hidden_act="silu",
        in_channels=3,
        out_hidden_size=3584,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        tokens_per_second=2,
        initializer_range=0.02,
    ),
    # Vision placeholders keep their published ids: our ~1k-token vocabulary never produces them.
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
    tie_word_embeddings=False,
)
# A cap: the prompt generators' text saturates Qwen's BPE at ~1.1k tokens, one token per common word.
QWEN_BPE_VOCAB_SIZE = 4096


@dataclass(frozen=True)
class Plan:
    """What one architecture's folder holds: weights to build (folder -> constructor that initialises
    on the current default device and dtype), small objects saved as they are (tokenizers, scheduler) and the
    pipeline's own config values model_index.json carries (Wan2.2's boundary_ratio)."""

    pipeline_class: type
    models: dict[str, Callable[[], nn.Module]]
    small: dict[str, object]
    config: dict[str, object] = field(default_factory=dict)


def merged(base: dict, overrides: dict | None) -> dict:
    """base updated with overrides; nested dicts merge key by key (the `scale` hook's rule)."""
    out = dict(base)
    for key, value in (overrides or {}).items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def sd35m_plan(scale: dict[str, dict] | None = None) -> Plan:
    """StableDiffusion3Pipeline at SD3.5-Medium size (or scaled by `scale`), random weights."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from diffrl.models.tiny.tokenizers import clip_tokenizer, t5_tokenizer

    scale = scale or {}
    # SD3's tokenizer_2 pads with "!" (CLIP-G), tokenizer with <|endoftext|> (CLIP-L), as upstream.
    tokenizer, tokenizer_2, tokenizer_3 = clip_tokenizer(), clip_tokenizer(pad_token="!"), t5_tokenizer()
    transformer = merged(SD35M_TRANSFORMER, scale.get("transformer"))
    vae = merged(SD35M_VAE, scale.get("vae"))
    clip_l = merged(CLIP_L_TEXT, scale.get("text_encoder"))
    clip_g = merged(CLIP_BIGG_TEXT, scale.get("text_encoder_2"))
    t5 = merged(T5_XXL_ENCODER, scale.get("text_encoder_3"))
    _check_sd35m(transformer, vae, clip_l, clip_g, t5, [tokenizer, tokenizer_2, tokenizer_3])
    t5_ids = dict(
        pad_token_id=tokenizer_3.pad_token_id,
        eos_token_id=tokenizer_3.eos_token_id,
        decoder_start_token_id=tokenizer_3.pad_token_id,
    )
    return Plan(
        pipeline_class=StableDiffusion3Pipeline,
        models={
            "transformer": lambda: SD3Transformer2DModel(**transformer),
            "vae": lambda: AutoencoderKL(**vae),
            "text_encoder": lambda: CLIPTextModelWithProjection(CLIPTextConfig(**clip_l, **_clip_ids(tokenizer))),
            "text_encoder_2": lambda: CLIPTextModelWithProjection(CLIPTextConfig(**clip_g, **_clip_ids(tokenizer_2))),
            "text_encoder_3": lambda: T5EncoderModel(T5Config(**t5, **t5_ids)),
        },
        small={
            "tokenizer": tokenizer,
            "tokenizer_2": tokenizer_2,
            "tokenizer_3": tokenizer_3,
            "scheduler": FlowMatchEulerDiscreteScheduler(**SD35M_SCHEDULER),
        },
    )


def _clip_ids(tokenizer) -> dict:
    # Our tokenizer's ids. With eos_token_id != 2, CLIP pools at the first <|endoftext|> (the published
    # configs' eos 2 selects the legacy argmax pooling, which needs <|endoftext|> to be the largest id).
    return dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )


def _check_sd35m(transformer: dict, vae: dict, clip_l: dict, clip_g: dict, t5: dict, tokenizers: list) -> None:
    """The widths the pipeline joins must agree (they do at real size; `scale` must keep them so)."""
    if transformer["joint_attention_dim"] != t5["d_model"]:
        raise ValueError(
            f"transformer.joint_attention_dim={transformer['joint_attention_dim']} must equal "
            f"text_encoder_3.d_model={t5['d_model']}"
        )
    if transformer["pooled_projection_dim"] != clip_l["projection_dim"] + clip_g["projection_dim"]:
        raise ValueError("transformer.pooled_projection_dim must equal the sum of both CLIP projection_dim")
    if clip_l["hidden_size"] + clip_g["hidden_size"] > t5["d_model"]:
        raise ValueError("the two CLIP hidden sizes must sum to at most text_encoder_3.d_model (zero-padded to it)")
    if transformer["in_channels"] != vae["latent_channels"]:
        raise ValueError("transformer.in_channels must equal vae.latent_channels")
    for tok, vocab in zip(tokenizers, (clip_l["vocab_size"], clip_g["vocab_size"], t5["vocab_size"])):
        assert len(tok) <= vocab, "in-memory tokenizer larger than the text encoder's vocabulary"


def qwen_image_plan(scale: dict[str, dict] | None = None) -> Plan:
    """QwenImagePipeline at Qwen-Image size (or scaled by `scale`), random weights."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from diffrl.models.tiny.qwen import ENDOFTEXT, IM_END

    scale = scale or {}
    tokenizer = qwen_prompt_tokenizer()
    transformer = merged(QWEN_IMAGE_TRANSFORMER, scale.get("transformer"))
    vae = merged(QWEN_IMAGE_VAE, scale.get("vae"))
    ids = {
        "bos_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
    }  # Qwen's: <|endoftext|>, <|im_end|>
    text = merged(merged(QWEN25_VL_7B, {"text_config": ids}), scale.get("text_encoder"))
    _check_qwen_image(transformer, vae, text, tokenizer)
    return Plan(
        pipeline_class=QwenImagePipeline,
        models={
            "transformer": lambda: QwenImageTransformer2DModel(**transformer),
            "vae": lambda: AutoencoderKLQwenImage(**vae),
            "text_encoder": lambda: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**text)),
        },
        small={"tokenizer": tokenizer, "scheduler": FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)},
    )


def _check_qwen_image(transformer: dict, vae: dict, text: dict, tokenizer) -> None:
    z_dim = vae.get("z_dim", 16)  # AutoencoderKLQwenImage's default
    if transformer["joint_attention_dim"] != text["text_config"]["hidden_size"]:
        raise ValueError("transformer.joint_attention_dim must equal text_encoder.text_config.hidden_size")
    if transformer["in_channels"] != 4 * z_dim or transformer["out_channels"] != z_dim:
        raise ValueError(f"transformer in/out channels must be 4 * z_dim / z_dim with the VAE's z_dim={z_dim}")
    assert len(tokenizer) <= text["text_config"]["vocab_size"], "tokenizer larger than the text vocabulary"


def qwen_prompt_tokenizer(vocab_size: int = QWEN_BPE_VOCAB_SIZE):
    """A Qwen2 byte-level BPE tokenizer with realistic token counts for the prompts diffrl trains on.

    diffrl/models/tiny/qwen.py's recipe (Qwen2's split regex, byte-level BPE, <|endoftext|> / <|im_start|> /
    <|im_end|> specials, Qwen-Image's template words learnt whole so the template prefix is exactly the 34
    tokens the pipeline drops), trained on 4,000 prompts from the OCR and GenEval-style generators plus the
    tiny corpus: their words become single tokens (~1 token per word, as with Qwen's 151k vocabulary).
    """
    from diffrl.engines.store.prompts import compositional_prompts, ocr_prompts
    from diffrl.models.tiny.qwen import qwen_tokenizer

    texts = [r.prompt for r in ocr_prompts(3000, seed=0)] + [r.prompt for r in compositional_prompts(1000, seed=0)]
    return qwen_tokenizer(vocab_size=vocab_size, extra_texts=texts)


def _wan22_a14b_plan(scale: dict[str, dict] | None = None) -> Plan:
    from diffrl.engines.realsize_wan import wan22_a14b_plan  # imports this module's helpers: imported on use

    return wan22_a14b_plan(scale)


PLANS: dict[str, Callable[[dict | None], Plan]] = {
    "sd35m": sd35m_plan,
    "qwen_image": qwen_image_plan,
    "wan22_a14b": _wan22_a14b_plan,
}


def plan_for(arch: str, scale: dict[str, dict] | None = None) -> Plan:
    """The Plan of `arch` (one of ARCHITECTURES); ValueError listing the choices otherwise."""
    if arch not in PLANS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    return PLANS[arch](scale)


def stored_numel(model: nn.Module) -> int:
    """Elements a checkpoint of `model` stores: parameters (tied ones once) and persistent buffers
    (e.g. SD3's 384x384 positional-embedding table, 226 M values at real size)."""
    n = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        n += sum(
            b.numel()
            for name, b in module._buffers.items()
            if b is not None and name not in module._non_persistent_buffers_set
        )
    return n


def meta_counts(plan: Plan) -> dict[str, tuple[int, int]]:
    """folder -> (parameters, stored elements) of each weight component, built on the meta device."""
    counts = {}
    for name, build in plan.models.items():
        with torch.device("meta"):
            model = build()
        counts[name] = (sum(p.numel() for p in model.parameters()), stored_numel(model))
        del model
    return counts


def build_random(
    arch: str,
    out_dir: str,
    *,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    scale: dict[str, dict] | None = None,
    weights: bool = True,
) -> str:
    """Write the `arch` pipeline (one of ARCHITECTURES) with random weights to out_dir; returns out_dir.

    One component at a time: initialised on `device` in `dtype` (seeded), saved as sharded safetensors,
    freed. ValueError (nothing written) for an unknown arch, an existing out_dir, an unusable device or
    dtype, or too little free disk space for parameters x bytes per value. `weights=False` writes the configs,
    tokenizers and scheduler only (built on the meta device: no weights made, a second), for `model.path:
    random:<out_dir>`, which builds the weights in memory (diffrl/models/random_weights.py).
    """
    start = time.perf_counter()
    if arch not in PLANS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    device = _usable_device(device)
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(map(str, DTYPES.values()))}; got {dtype!r}")
    out_dir = os.path.normpath(out_dir)
    if os.path.lexists(out_dir):
        raise ValueError(f"OUT_DIR {out_dir!r} already exists; remove it or choose a new folder")
    plan = plan_for(arch, scale)
    counts = meta_counts(plan)
    need = (sum(stored for _, stored in counts.values()) * _itemsize(dtype) if weights else 0) + DISK_MARGIN_BYTES
    tmp = out_dir + ".tmp"
    _remove_leftover(tmp)
    free = check_disk_space(tmp, need)
    what = f"~{need / 1e9:.1f} GB in {_dtype_name(dtype)}" if weights else "configs only, no weights"
    _progress(
        f"{arch}: {sum(n for n, _ in counts.values()):,} parameters, {what} into {tmp} ({free / 1e9:.1f} GB free)"
    )
    os.makedirs(tmp)
    open(os.path.join(tmp, _MARKER), "w").close()
    index: dict[str, object] = {}
    for i, (name, build) in enumerate(plan.models.items()):
        if weights:
            index[name] = _write_model(
                name, build, os.path.join(tmp, name), device=device, dtype=dtype, seed=seed * 100 + i
            )
        else:
            index[name] = _write_config(build, os.path.join(tmp, name), dtype=dtype)
    for name, obj in plan.small.items():
        obj.save_pretrained(os.path.join(tmp, name))
        index[name] = _library_and_class(obj)
    index.update(plan.config)
    _write_model_index(plan, index, tmp)  # last: until now the folder is not a pipeline
    os.remove(os.path.join(tmp, _MARKER))
    os.rename(tmp, out_dir)
    _progress(f"{arch}: wrote {out_dir} in {time.perf_counter() - start:.1f} s")
    return out_dir


def check_disk_space(path: str, need: int) -> int:
    """Free bytes on the filesystem that will hold `path`; ValueError when fewer than `need`."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    if free < need:
        raise ValueError(
            f"not enough disk space for {path!r}: the folder needs ~{need / 1e9:.1f} GB ({need:,} bytes = "
            f"parameters x bytes per value + {DISK_MARGIN_BYTES // 2**20} MiB), but {probe!r} has "
            f"{free / 1e9:.1f} GB ({free:,} bytes) free; --configs-only writes the configs alone (a few MB) for "
            "model.path=random:OUT_DIR, which builds the weights in memory"
        )
    return free


def _write_model(
    name: str, build: Callable[[], nn.Module], path: str, *, device: torch.device, dtype: torch.dtype, seed: int
) -> list[str]:
    """Initialise one component on device in dtype, save it sharded, free it; its model_index entry."""
    start = time.perf_counter()
    with seeded(seed, device), default_dtype(dtype), device:
        model = build()
    # Buffers the constructors make in fp32 on purpose (SD3's sin-cos table) are stored in dtype as well.
    # nn.Module.to: diffusers' ModelMixin.to warns about fp32-kept modules, which these models have none of.
    model = nn.Module.to(model, dtype).eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    built = time.perf_counter()
    entry = _library_and_class(model)
    kwargs = {"safe_serialization": True} if entry[0] == "diffusers" else {}  # transformers 5: always
    model.save_pretrained(path, max_shard_size=MAX_SHARD_SIZE, **kwargs)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _progress(
        f"{name} ({entry[1]}): {parameters:,} parameters, init {built - start:.1f} s, "
        f"save {time.perf_counter() - built:.1f} s"
    )
    return entry


def _write_config(build: Callable[[], nn.Module], path: str, *, dtype: torch.dtype) -> list[str]:
    """One component's config alone (the model built on the meta device); its model_index entry."""
    with default_dtype(dtype), torch.device("meta"):
        model = build()
    entry = _library_and_class(model)
    if entry[0] == "diffusers":
        model.save_config(path)
    else:
        model.config.save_pretrained(path)
    return entry


def _write_model_index(plan: Plan, index: dict[str, object], folder: str) -> None:
    """model_index.json as `DiffusionPipeline.save_pretrained` writes it (absent optional parts: [null, null])."""
    import diffusers

    cls = plan.pipeline_class
    expected = set(inspect.signature(cls.__init__).parameters) - {"self"}
    optional = set(cls._optional_components)
    assert set(index) <= expected and expected - optional <= set(index), f"{cls.__name__} takes {sorted(expected)}"
    full = {"_class_name": cls.__name__, "_diffusers_version": diffusers.__version__, **index}
    for name in optional - set(index):
        full[name] = [None, None]
    with open(os.path.join(folder, "model_index.json"), "w") as f:
        f.write(json.dumps(full, indent=2, sort_keys=True) + "\n")


def _library_and_class(obj: object) -> list[str]:
    """["diffusers" | "transformers", class name]: a model_index.json entry."""
    return [type(obj).__module__.split(".")[0], type(obj).__name__]


def _usable_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device {str(device)!r} is not a torch device (use cuda, cuda:N or cpu): {err}") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda, cuda:N or cpu; got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: CUDA is not available here; use a GPU machine or device cpu")
    return device


def _remove_leftover(tmp: str) -> None:
    """Remove a previous interrupted write (it carries our marker file); refuse any other folder."""
    if not os.path.lexists(tmp):
        return
    if not os.path.isfile(os.path.join(tmp, _MARKER)):
        raise ValueError(f"{tmp!r} exists and is not an interrupted `diffrl random-model` write; remove it")
    shutil.rmtree(tmp)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def _progress(message: str) -> None:
    print(f"diffrl random-model: {message}", file=sys.stderr, flush=True)
