"""One RL step as a Prefect flow: the step core's stage sequence (diffrl/engines/step/run.py) with its stages as Prefect
tasks (diffrl/tasks/stages.py), for policy-gradient and direct-preference algorithms alike.

    online:  for each chunk: generate(chunk) ; score(chunk) runs while the next chunk generates
    offline: offline_pairs(step)
    advantages(step) -> update_actor(step) (+ checkpoint) -> sync_weights(step) (+ the next step's rollout)

Every task is keyed by (run, step, stage, chunk) with a persisted result: retrying this flow run
(Prefect UI "Retry", or a resumed `diffrl train`) reruns only the stages that did not complete.
"""

from __future__ import annotations

import logging
from uuid import UUID

from prefect import flow
from prefect.context import FlowRunContext
from prefect.runtime import flow_run

from diffrl.engines import cluster, trace
from diffrl.engines.numbering import step_number
from diffrl.engines.step.run import run_step
from diffrl.tasks.stages import PrefectStages

log = logging.getLogger("diffrl")

# Step subflow runs kept in Prefect's database: each adds a flow run, its stage task runs and their states (~30 KB a
# step on SQLite); older ones are deleted after each step. A retry (the UI's, or a resumed run) starts at the step
# after the last checkpoint, always among these.
KEEP_STEP_RUNS = 20
# run name -> {step: (its subflow run's id, the id of the task run tracking that call in the train flow run)}
_STEP_RUNS: dict[str, dict[int, tuple[UUID, UUID | None]]] = {}


def step_run_name() -> str:
    """The subflow run's name: <run>-step-<k>, k the step number (diffrl/engines/numbering.py)."""
    parameters = flow_run.parameters
    return f"{parameters['run_name']}-step-{step_number(parameters['step'])}"


# validate_parameters=False: Prefect would build a pydantic model of (run_name, step) for every step (~10 ms of the
# flow thread's GIL a step, which the engines' threads wait for)
@flow(name="rl_step", flow_run_name=step_run_name, log_prints=False, validate_parameters=False)
def rl_step(run_name: str, step: int) -> dict:
    """Run step `step` of run `run_name` on its registered engines; returns the step's metrics."""
    context = FlowRunContext.get()
    if context is not None and context.flow_run is not None:
        _STEP_RUNS.setdefault(run_name, {})[step] = (context.flow_run.id, context.flow_run.parent_task_run_id)
    engines = cluster.get(run_name)  # cluster.mode ray: each stage runs as a Ray task calling the run's actors
    with trace.span("run_step", step=step):
        return run_step(engines, step, PrefectStages(run_name, engines.config)).metrics


def forget_old_step_runs(run_name: str, step: int) -> int:
    """After `step` is done: delete from Prefect's database the step subflow runs this process ran for steps before
    the last KEEP_STEP_RUNS (their stage task runs and states go with them) and the train flow run's task runs that
    tracked those calls. A deletion the server refuses now (busy) is tried again after the next step. Returns how
    many subflow runs were deleted."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    runs = _STEP_RUNS.get(run_name, {})
    old = [k for k in runs if k <= step - KEEP_STEP_RUNS]
    if not old:
        return 0
    deleted = 0
    with get_client(sync_client=True) as client:
        for k in old:
            flow_run_id, parent_id = runs[k]
            try:
                for delete, run_id in ((client.delete_flow_run, flow_run_id), (client.delete_task_run, parent_id)):
                    try:
                        if run_id is not None:
                            delete(run_id)
                    except ObjectNotFound:  # gone already (a retry of this deletion)
                        pass
            except Exception as e:  # noqa: BLE001 - retention must not fail a training step
                log.debug("could not delete step %d's Prefect runs yet: %s", k, e)
                continue
            del runs[k]
            deleted += 1
    return deleted
