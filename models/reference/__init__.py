"""Reference models that diffrl trains itself and ships (docs/reference-model.md).

- `pretrain_shapes`: a small SD3-architecture text-to-image model pretrained from scratch on the
  procedural shape scenes of engines/store/scenes.py, so RL with the `geneval_lite` reward visibly
  improves a real (not random) model in minutes.
"""
