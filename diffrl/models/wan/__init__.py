"""Wan video (diffusers `WanPipeline`: Wan2.1, and Wan2.2 with its two experts; `WanImageToVideoPipeline`: Wan2.2
A14B image-to-video and first/last-frame-to-video): the adapters (adapter.py, the "wan" architecture; adapter_i2v.py,
"wan_i2v"), the tiny builders (tiny.py: "wan", "wan22" and "wan_i2v") and Wan2.2 A14B's real-size configs (realsize.py,
"wan22_a14b" and "wan22_i2v_a14b")."""
