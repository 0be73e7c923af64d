"""Z-Image (diffusers `ZImagePipeline`): the adapter (adapter.py, the "z_image" architecture) and the tiny builder
(tiny.py)."""
