"""Janus-Pro image generation (transformers `JanusForConditionalGeneration`) as an autoregressive token policy: the
policy (policy.py) and the tiny builder (tiny.py, "janus")."""
