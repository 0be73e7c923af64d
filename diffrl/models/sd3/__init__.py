"""Stable Diffusion 3 / 3.5 (diffusers `StableDiffusion3Pipeline`): the adapter (adapter.py, the "sd3"
architecture), the tiny builder (tiny.py) and SD3.5-Medium's real-size configs (realsize.py, "sd35m")."""
