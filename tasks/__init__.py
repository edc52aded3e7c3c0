"""Prefect tasks: orchestration around training/ (subprocesses, caching, retries, artifacts)."""

import logging

from prefect import get_run_logger
from prefect.exceptions import MissingContextError


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a run; a plain logger when a task is called via `.fn`."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("trainflow")
