"""Prefect tasks: orchestration around training/ (subprocesses, caching, retries, artifacts)."""

import logging

from prefect import get_run_logger
from prefect.cache_policies import INPUTS, RUN_ID, TASK_SOURCE
from prefect.exceptions import MissingContextError

RESUMABLE = {"persist_result": True, "result_serializer": "json",
             "cache_policy": INPUTS + TASK_SOURCE + RUN_ID}
"""A stage that a retried flow run does not redo (Prefect's persisted results and cache
policy): its result is kept as JSON, never pickled, and found again only by the same flow run
with the same inputs and the same task code, so nothing is reused across data or specs."""

MLFLOW_RETRIES = {"retries": 3, "retry_delay_seconds": [5, 15, 30]}
"""For the stages that write to MLflow: 50 s in all, longer than a tracking server's restart
(a whole epoch's metrics, an evaluation or a registration is not lost to one)."""


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a run; a plain logger when a task is called via `.fn`."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("trainflow")
