"""Wan text-to-video (diffusers `WanPipeline`: Wan2.1, and Wan2.2 with its two experts): the adapter (adapter.py, the
"wan" architecture), the tiny builders (tiny.py: "wan" and "wan22") and Wan2.2 T2V A14B's real-size configs
(realsize.py, "wan22_a14b")."""
