"""MLflow logging from the main training process that never costs a training run.

If the tracking server goes away mid-training, metrics are kept and retried on the next
call and at the end; training carries on and the weights stay on disk either way.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

# Fail fast instead of MLflow's default minutes of HTTP retries: the next epoch retries anyway.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


class RunLogger:
    """Logs into an existing MLflow run by id (the flow owns the run; we never end it)."""

    def __init__(self, run_id: str | None, tracking_uri: str | None,
                 on_error: Callable[[str], None] = lambda message: None):
        self.run_id = run_id
        self._on_error = on_error
        self._pending: list[tuple[str, Any]] = []
        self._client = None
        if run_id:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=tracking_uri)

    @property
    def enabled(self) -> bool:
        return self._client is not None

    def log_params(self, params: dict[str, Any]) -> None:
        self._send(("params", {k: str(v) for k, v in params.items()}))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._send(("metrics", (metrics, step)))

    def flush(self) -> int:
        """Retry what could not be sent; return how many batches are still unsent."""
        if self.enabled and self._pending:
            pending, self._pending = self._pending, []
            for item in pending:
                self._send(item, retry_pending=False)
        return len(self._pending)

    def _send(self, item: tuple[str, Any], retry_pending: bool = True) -> None:
        if not self.enabled:
            return
        if retry_pending:
            self.flush()
        from mlflow.entities import Metric, Param

        kind, payload = item
        try:
            if kind == "params":
                self._client.log_batch(
                    self.run_id, params=[Param(k, v) for k, v in payload.items()]
                )
            else:
                metrics, step = payload
                import time

                now = int(time.time() * 1000)
                self._client.log_batch(
                    self.run_id,
                    metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()],
                )
        except Exception as e:  # any failure of the tracking server must not stop training
            if kind == "params" and "Changing param values is not allowed" in str(e):
                return  # a resumed run logs the same params again
            self._pending.append(item)
            self._on_error(f"{type(e).__name__}: {str(e)[:300]}")
