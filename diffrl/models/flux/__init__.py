"""FLUX.1 (diffusers `FluxPipeline`): the adapter (adapter.py, the "flux" architecture) and the tiny builder
(tiny.py)."""
