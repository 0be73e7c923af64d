"""Qwen-Image-2.1 (diffusers `QwenImage21Pipeline`): the adapter (adapter.py, the "qwen_image21" architecture), the
tiny builder (tiny.py) and the real-size configs (realsize.py, "qwen_image21"). Its own folder: the transformer, text
encoder, VAE and guidance differ from Qwen-Image's (diffrl/models/qwen_image/)."""
