"""Pretraining of the shipped reference models on the shape scenes (docs/reference-model.md), one entry module per
model: sd3.py (`shapes`, `shapes-small`; its model and settings in sd3_model.py), janus.py (`shapes-janus`),
thinker.py (`shapes-thinker`). Each runs as `python -m diffrl.shapes.pretrain.<module> --out DIR ...`."""
