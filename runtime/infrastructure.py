"""A flow run started by a process worker ends with that worker.

Prefect's process worker starts each flow run in a session of its own, so a worker that dies
(SIGKILL, an OOM kill, a crashed machine agent) leaves its flow runs running where no worker
can cancel them, and their training ranks holding every core and GPU. Here the flow run asks
Linux for a SIGTERM when its worker dies: Prefect's engine turns that SIGTERM into a Crashed
state on the server at once, and the launch (tied to this process in turn) takes its ranks down.
A later run of the deployment starts clean, or resumes the crashed run's checkpoint when it is
the same flow run retried. A flow started by hand is never affected.
"""

from __future__ import annotations

import os
import signal

import psutil

from training.processes import die_with_parent


def started_by_worker() -> int | None:
    """The pid of the Prefect worker that started this flow-run process, if one did."""
    from prefect.runtime import deployment

    if not deployment.get_id():  # a worker runs deployments' runs only
        return None
    try:
        parent = psutil.Process(os.getppid())
        command = " ".join(parent.cmdline())
    except psutil.Error:
        return None
    return parent.pid if "prefect" in command and " worker " in f" {command} " else None


def end_with_worker() -> None:
    if (worker := started_by_worker()) is not None:
        die_with_parent(signal.SIGTERM, worker)
