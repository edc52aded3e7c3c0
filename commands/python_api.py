"""train-flow from Python, as `trainflow train` runs it:

    from commands.python_api import train
    result = train(dataset={"source": "/data/flowers"}, training={"epochs": 3})
    print(result.registration.version, result.mlflow_url)

On PREFECT_API_URL when it is set, else on the local Prefect server hand-started runs share
(started the first time, reused after: commands/local_server.py), so the run stays listed in
that server's UI. Calling `flows.train_flow.train_flow(...)` directly without PREFECT_API_URL
makes Prefect start a temporary server for that one call instead (seconds each time, and its
runs are gone with it). Raises what the flow raised when it fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def hand_started_prefect() -> Iterator[str]:
    """PREFECT_API_URL or the reused local server for the enclosed flow calls, with the
    results block a remote root needs (runtime.remote.save_result_storage) saved on it."""
    from commands.local_server import local_prefect_api

    with local_prefect_api() as url:
        from runtime.remote import save_result_storage

        save_result_storage()
        yield url


def train(**params: Any):
    """One train-flow run with these parameters (the flow's: dataset, split, training,
    registry, force), to its FlowResult."""
    with hand_started_prefect():
        from flows.train_flow import train_flow

        return train_flow(**params)
