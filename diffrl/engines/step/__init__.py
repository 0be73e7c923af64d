"""The RL step core: the stage functions every caller runs (the Prefect tasks in diffrl/tasks/, the benchmarks), their
typed results, and the in-process hand-off between them.

    plan.py        what a step samples (chunks, seeds, the validation batch)
    generate.py    generate / score / offline_pairs stages, the next step's prefetch
    update.py      advantages / update (+ checkpoint) / weight-sync stages
    run.py         run_step: the stage sequence, with Prefect tasks or direct calls
    memory.py      the step in flight kept in memory, background writer and rollout/reward workers
    records.py     the stages' typed results
"""
