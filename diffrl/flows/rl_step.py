"""One RL step as a Prefect flow: the step core's stage sequence (diffrl/engines/step/run.py) with its stages as Prefect
tasks (diffrl/tasks/stages.py), for policy-gradient and direct-preference algorithms alike.

    online:  for each chunk: generate(chunk) ; score(chunk) runs while the next chunk generates
    offline: offline_pairs(step)
    advantages(step) -> update_actor(step) (+ checkpoint) -> sync_weights(step) (+ the next step's rollout)

Every task is keyed by (run, step, stage, chunk) with a persisted result: retrying this flow run
(Prefect UI "Retry", or a resumed `diffrl train`) reruns only the stages that did not complete.
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from diffrl.engines import cluster, trace
from diffrl.engines.numbering import step_number
from diffrl.engines.step.run import run_step
from diffrl.tasks.stages import PrefectStages


def step_run_name() -> str:
    """The subflow run's name: <run>-step-<k>, k the step number (diffrl/engines/numbering.py)."""
    parameters = flow_run.parameters
    return f"{parameters['run_name']}-step-{step_number(parameters['step'])}"


# validate_parameters=False: Prefect would build a pydantic model of (run_name, step) for every step (~10 ms of the
# flow thread's GIL a step, which the engines' threads wait for)
@flow(name="rl_step", flow_run_name=step_run_name, log_prints=False, validate_parameters=False)
def rl_step(run_name: str, step: int) -> dict:
    """Run step `step` of run `run_name` on its registered engines; returns the step's metrics."""
    engines = cluster.get(run_name)  # cluster.mode ray: each stage runs as a Ray task calling the run's actors
    with trace.span("run_step", step=step):
        return run_step(engines, step, PrefectStages(run_name, engines.config)).metrics
