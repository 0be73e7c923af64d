"""What a run prints where no `diffrl` command set the console up: a deployment's flow run, started by a Prefect
worker (`python -m prefect.engine`), gets the quieting `diffrl train` gives itself (diffrl/flows/cli.py), and every
console shows a failure's traceback once."""

from __future__ import annotations

import logging
import os
import warnings
from collections import deque

# DiffusionNFT's "old" adapter is a second adapter by design: peft's warning about it is not for the user
PEFT_SECOND_ADAPTER = "Already found a `peft_config` attribute in the model"


class OneTraceback(logging.Filter):
    """A failure's traceback once per console. Prefect logs a failed task's exception, then again for the step flow
    that ran the task, the train flow that ran that, and the engine that ran the flow: four tracebacks of one error
    (about 400 lines for one injected fault). A record whose exception, or one in its cause/context chain, was shown
    already keeps its message line and loses the traceback. Put on console handlers only: Prefect's API handler,
    which feeds the UI's log of each run, formats a record before the root logger's handlers see it."""

    def __init__(self):
        super().__init__()
        self._shown: deque[BaseException] = deque(maxlen=64)  # a handful per run; kept alive to compare by identity

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None:
            return True
        if any(shown is e for e in _chain(error) for shown in self._shown):
            record.exc_info = None
            record.exc_text = None
        else:
            self._shown.append(error)
        return True


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while error is not None and not any(error is e for e in seen):
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def one_traceback(handler: logging.Handler) -> None:
    """Give `handler` a OneTraceback filter (once)."""
    if not any(isinstance(f, OneTraceback) for f in handler.filters):
        handler.addFilter(OneTraceback())


def quiet_deployment_run() -> None:
    """In a deployment's flow-run process (Prefect's workers set PREFECT__FLOW_RUN_ID; `diffrl train` never does):
    MLflow's INFO lines, transformers' notices, the loading and saving bars of transformers, diffusers and the Hub,
    and peft's second-adapter warning stay out of the worker's console, as under `diffrl train`; a failure shows one
    traceback. The libraries are imported by now, so their levels are set directly; a variable the user exported
    (TRANSFORMERS_VERBOSITY, MLFLOW_LOGGING_LEVEL, HF_HUB_DISABLE_PROGRESS_BARS) wins, and DIFFRL_VERBOSE=1 keeps
    everything. Prefect's own lines are left as the worker configured them: they are also the run's log in its UI."""
    if not os.environ.get("PREFECT__FLOW_RUN_ID"):
        return
    for handler in logging.getLogger().handlers:
        one_traceback(handler)
    if os.environ.get("DIFFRL_VERBOSE"):
        return
    import diffusers
    import huggingface_hub
    import transformers

    if "MLFLOW_LOGGING_LEVEL" not in os.environ:
        logging.getLogger("mlflow").setLevel(logging.WARNING)
    if "TRANSFORMERS_VERBOSITY" not in os.environ:
        transformers.utils.logging.set_verbosity_error()
    if "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ:
        transformers.utils.logging.disable_progress_bar()
        diffusers.utils.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()
    warnings.filterwarnings("ignore", message=PEFT_SECOND_ADAPTER)
