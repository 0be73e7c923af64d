"""HunyuanImage-3.0 (Tencent Hunyuan, arXiv 2509.23951) text-to-image: the MoE backbone (moe.py), the image head
(model.py), the VAE decoder (vae.py), the official checkpoint folder (layout.py) and the adapter (adapter.py),
registered as the "hunyuan_image3" architecture when this package is imported."""

from diffrl.models.hunyuan_image3.adapter import HunyuanImage3Adapter, HunyuanImage3Pipeline

__all__ = ["HunyuanImage3Adapter", "HunyuanImage3Pipeline"]
