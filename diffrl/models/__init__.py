"""Model adapters, one file per architecture (models.base.ADAPTER_MODULES); each registers itself with
models.base.register_adapter when imported. They are imported on demand: loading an SD3 folder imports
diffrl/models/sd3.py (and the diffusers and transformers classes it needs), not every architecture's."""
