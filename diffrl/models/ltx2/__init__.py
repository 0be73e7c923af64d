"""LTX-2 text-to-video-with-audio (diffusers `LTX2Pipeline`: Lightricks/LTX-2, LTX-2.3): the adapter (adapter.py, the
"ltx2" architecture: video and audio latents packed into one tensor), the tiny builder (tiny.py, "ltx2") and LTX-2's
real-size config (realsize.py, "ltx2")."""
