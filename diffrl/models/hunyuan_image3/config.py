"""The fields of HunyuanImage-3.0's `config.json` that the text-to-image path reads.

Names and defaults as the reference `HunyuanImage3Config` (github.com/Tencent-Hunyuan/HunyuanImage-3.0,
`hunyuan_image_3/configuration_hunyuan.py`); the released checkpoint's config.json stores the MoE fields
(`num_experts`, `moe_topk`, `moe_intermediate_size`, `num_shared_expert`) as per-layer lists, so each may be an int
or a list of `num_hidden_layers` values (`per_layer`). `vae` is the VAE's config dict (autoencoder_kl_3d.py's
`AutoencoderKLConv3D` arguments).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

PER_LAYER = ("num_experts", "moe_topk", "moe_intermediate_size", "num_shared_expert")
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "vae")


@dataclass
class HunyuanImage3Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vae: dict
    num_key_value_heads: int | None = None
    attention_head_dim: int | None = None
    intermediate_size: int = 11008
    moe_intermediate_size: int | list | None = None
    num_experts: int | list = 1
    moe_topk: int | list = 1
    num_shared_expert: int | list = 1
    use_mixed_mlp_moe: bool = False
    moe_layer_num_skipped: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False
    mlp_bias: bool = False
    use_qk_norm: bool = False
    hidden_act: str = "silu"
    img_proj_type: str = "unet"
    patch_size: int = 1
    patch_embed_hidden_dim: int = 1024
    vae_downsample_factor: tuple = (16, 16)
    image_base_size: int = 1024
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.attention_head_dim is None:
            self.attention_head_dim = self.hidden_size // self.num_attention_heads
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        self.vae_downsample_factor = tuple(self.vae_downsample_factor)
        for name in PER_LAYER:
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != self.num_hidden_layers:
                raise ValueError(f"config.json {name}: {len(value)} values for {self.num_hidden_layers} layers")
        checks = {
            "hidden_act": (self.hidden_act, ("silu",)),
            "img_proj_type": (self.img_proj_type, ("unet",)),
            "patch_size": (self.patch_size, (1,)),  # the reference allows 1, 2, 4, 8; the release uses 1
            "use_qk_norm": (self.use_qk_norm, (True,)),
        }
        for name, (value, allowed) in checks.items():
            if value not in allowed:
                raise ValueError(f"config.json {name}={value!r} is not supported; HunyuanImage-3.0 uses {allowed}")

    @property
    def head_dim(self) -> int:
        return int(self.attention_head_dim)

    @property
    def latent_channels(self) -> int:
        return int(self.vae["latent_channels"])

    @property
    def vae_factor(self) -> int:
        """Pixels per latent token side (the VAE's spatial factor times the patch size)."""
        if self.vae_downsample_factor[0] != self.vae_downsample_factor[1]:
            raise ValueError(f"vae_downsample_factor={self.vae_downsample_factor}: only square factors are supported")
        return int(self.vae_downsample_factor[0]) * self.patch_size

    def per_layer(self, name: str, layer: int) -> int:
        value = getattr(self, name)
        return int(value[layer] if isinstance(value, list) else value)

    @classmethod
    def from_dict(cls, raw: dict, *, source: str = "config.json") -> "HunyuanImage3Config":
        """The known fields of a config.json dict (the rest kept in `extra`); ValueError naming missing ones."""
        missing = [k for k in REQUIRED if k not in raw]
        if missing:
            raise ValueError(f"{source} lacks {missing} (not a HunyuanImage-3.0 config)")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in raw.items() if k in names}
        return cls(**known, extra={k: v for k, v in raw.items() if k not in names})
