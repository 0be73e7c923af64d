"""BAGEL (ByteDance-Seed, arXiv 2505.14683) text-to-image: the MoT model (mot.py), the official checkpoint folder
(layout.py), the adapter (adapter.py, the "bagel" architecture), the tiny builder (tiny.py) and the configs-only
BAGEL-7B-MoT folder (realsize.py)."""
