"""The shapes task kit: a text-to-image, an editing and a question-answering task on procedural shape scenes, the
rule rewards that check them, and the pretraining of the reference models RL starts from.

    scenes.py        GenEval-style targets, scene sampling and drawing, captions, and the caption prompt sets
                     with their targets (source `generator:shapes`, data/shapes_heldout.jsonl)
    questions.py     questions about drawn scenes (sources `generator:shapes_qa*`, the omni quickstart)
    edits.py         recolour instructions with their input scenes (source `generator:shapes_edit`)
    geneval_lite.py  the `geneval_lite` reward: palette segmentation, shape rules, GenEval's scoring
    edit_reward.py   the `shapes_edit` reward: was the asked object recoloured and the rest kept
    pretrain/        the reference models of diffrl/models/reference: sd3.py with sd3_model.py (`shapes`,
                     `shapes-small`), janus.py (`shapes-janus`), thinker.py (`shapes-thinker`)

The kit sits above the engines (it builds on their prompt records and reward protocol) and beside the Prefect tasks;
nothing under diffrl/engines imports it. Its rewards register through the one registry (diffrl/registry.py,
KIT_MODULES), so configs name them as they name the built-in ones.
"""
