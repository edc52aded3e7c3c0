"""MLflow logging that never costs (or slows) a training run.

Used by the process that watches a launch (tasks/train.py forwards rank 0's reports), or by
the main process of `training.train` when its job names a run. A background thread owns
the MLflow client: creating it (a SQLite store checks its schema,
an HTTP one may time out) and every call happen off the training loop. If the tracking
server goes away mid-training, metrics are kept and retried with the next batch and at the
end; training carries on and the weights stay on disk either way.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any


def fail_fast_http() -> None:
    """One retry and a 10 s timeout instead of MLflow's default minutes of HTTP retries.

    For the whole process (MLflow reads these per request), unless set already: the next
    metric batch retries anyway, and Prefect retries the flow's MLflow tasks.
    """
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


fail_fast_http()

_STOP = object()


class RunLogger:
    """Logs into an existing MLflow run by id (the flow owns the run; we never end it)."""

    def __init__(self, run_id: str | None, tracking_uri: str | None,
                 on_error: Callable[[str], None] = lambda message: None):
        self.run_id = run_id
        self._uri = tracking_uri
        self._on_error = on_error
        self._pending: list[tuple[str, Any]] = []
        self._queue: queue.Queue = queue.Queue()
        self._client = None
        self._thread = None
        if run_id:
            self._thread = threading.Thread(target=self._work, name="mlflow-logger", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._thread is not None

    def log_params(self, params: dict[str, Any]) -> None:
        if self.enabled:
            self._queue.put(("params", {k: str(v) for k, v in params.items()}))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.enabled:
            now = int(time.time() * 1000)
            self._queue.put(("metrics", (metrics, step, now)))

    def flush(self, timeout: float = 120) -> int:
        """Send what is queued, retry what failed; return how many batches remain unsent."""
        if not self.enabled:
            return 0
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            return self._queue.qsize() + len(self._pending)
        self._retry_pending()
        return len(self._pending)

    def _work(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            self._retry_pending()
            self._send(item)

    def _retry_pending(self) -> None:
        pending, self._pending = self._pending, []
        for item in pending:
            self._send(item)

    def _send(self, item: tuple[str, Any]) -> None:
        from mlflow.entities import Metric, Param

        kind, payload = item
        try:
            if self._client is None:
                from mlflow import MlflowClient

                self._client = MlflowClient(tracking_uri=self._uri)
            if kind == "params":
                self._client.log_batch(self.run_id,
                                       params=[Param(k, v) for k, v in payload.items()])
            else:
                metrics, step, now = payload
                self._client.log_batch(
                    self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])
        except Exception as e:  # any failure of the tracking server must not stop training
            if kind == "params" and "Changing param values is not allowed" in str(e):
                return  # a resumed run logs the same params again
            self._pending.append(item)
            self._on_error(f"{type(e).__name__}: {str(e)[:300]}")
