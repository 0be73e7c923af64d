"""Reference models that diffrl trains itself and ships (docs/reference-model.md): `shapes` and `shapes-small`,
small SD3-architecture text-to-image models pretrained from scratch (diffrl/shapes/pretrain/sd3.py) on
the procedural shape scenes of diffrl/shapes/scenes.py, so RL with the `geneval_lite` reward visibly
improves a real (not random) model in minutes. `shapes-thinker` is the autoregressive quickstart's warm start
(diffrl/shapes/pretrain/thinker.py) and `shapes-janus` a Janus-Pro-architecture text-to-image model on the
same scenes (diffrl/shapes/pretrain/janus.py), for RL on image tokens.
"""
