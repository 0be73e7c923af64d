"""Stable Audio 3 text-to-audio (diffusers `StableAudio3Pipeline`): the adapter (adapter.py, the "stable_audio3"
architecture), the tiny builder (tiny.py) and Stable Audio 3 Medium's real-size configs (realsize.py,
"stable_audio3_medium")."""
