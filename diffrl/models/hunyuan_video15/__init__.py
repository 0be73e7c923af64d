"""HunyuanVideo-1.5 text-to-video (diffusers `HunyuanVideo15Pipeline`): the adapter (adapter.py, the
"hunyuan_video15" architecture), the tiny builder (tiny.py) and the 480p T2V real-size config (realsize.py,
"hunyuan_video15_480p")."""
