"""Reference models that diffrl trains itself and ships (docs/reference-model.md): `shapes` and `shapes-small`,
small SD3-architecture text-to-image models pretrained from scratch (diffrl/engines/train/pretrain_shapes.py) on
the procedural shape scenes of diffrl/engines/store/scenes.py, so RL with the `geneval_lite` reward visibly
improves a real (not random) model in minutes.
"""
