"""HunyuanImage-3.0 (Tencent Hunyuan, arXiv 2509.23951) text-to-image: the MoE backbone (moe.py), the image head
(model.py), the VAE decoder (vae.py), the official checkpoint folder (layout.py), the adapter (adapter.py, the
"hunyuan_image3" architecture), the tiny builder (tiny.py) and the configs-only released-size folder (realsize.py)."""
