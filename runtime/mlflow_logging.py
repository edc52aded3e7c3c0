"""Forwarding rank 0's reported params and epoch metrics to MLflow, never holding up training.

The task process does this, not a rank: the ranks then never import MLflow or open its store
(about 2.5 s of CPU on a SQLite store, taken from training on a small machine), and a tracking
server that stalls or dies can only delay this watcher, never a rank. MLflow's own
asynchronous logging sends the batches; what it cannot do is kept here and small: the client
is opened off the watcher's thread, and batches that failed are retried once at the end and
counted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


def fail_fast_http() -> None:
    """One retry and a 10 s timeout instead of MLflow's default minutes of HTTP retries.

    For the whole process (MLflow reads these per request), unless set already: a failed
    batch is retried at the end anyway, and Prefect retries the flow's MLflow tasks.
    """
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


fail_fast_http()


class EpochLogger:
    """Logs into an existing MLflow run by id (the flow owns the run; this never ends it)."""

    def __init__(self, run_id: str | None, tracking_uri: str | None,
                 on_error: Callable[[str], None] = lambda message: None):
        self.run_id = run_id
        self._on_error = on_error
        self._sent: list[tuple[dict, Any]] = []  # (batch, MLflow's pending operation or error)
        self._client: Future | None = None
        if run_id:
            self._opener = ThreadPoolExecutor(1, thread_name_prefix="mlflow-client")
            self._client = self._opener.submit(_client, tracking_uri)

    def log_params(self, params: dict[str, Any]) -> None:
        self._log({"params": {k: str(v) for k, v in params.items()}})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._log({"metrics": metrics, "step": step, "timestamp": int(time.time() * 1000)})

    def flush(self, patience_s: float | None = None) -> int:
        """Wait for what was sent; resend what failed, with backoff, for up to `patience_s`
        (TRAINFLOW_MLFLOW_PATIENCE_S, default 60 s: a server restarted meanwhile gets every
        epoch); return how many batches are still unsent."""
        if self._client is None:
            return 0
        if patience_s is None:
            patience_s = float(os.environ.get("TRAINFLOW_MLFLOW_PATIENCE_S", "60"))
        failed = []
        for batch, operation in self._sent:
            try:
                if isinstance(operation, Exception):
                    raise operation
                operation.wait()
            except Exception as e:
                failed.append((batch, e))
        self._sent.clear()
        deadline, delay = time.monotonic() + patience_s, 1.0
        while failed:
            still = []
            for batch, _ in failed:
                try:
                    self._send(batch, synchronous=True)
                except Exception as e:
                    if not self._already_logged(batch):
                        still.append((batch, e))
            failed = still
            if not failed or time.monotonic() + delay > deadline:
                break
            time.sleep(delay)
            delay = min(2 * delay, 10.0)
        for _, error in failed:
            self._on_error(f"{type(error).__name__}: {str(error)[:300]}")
        return len(failed)

    def _log(self, batch: dict) -> None:
        if self._client is None:
            return
        try:
            self._sent.append((batch, self._send(batch, synchronous=False)))
        except Exception as e:  # the client could not even be made: keep the batch for flush
            self._sent.append((batch, e))

    def _already_logged(self, batch: dict) -> bool:
        """A resumed training reports its params again, which MLflow refuses to log twice:
        refused params that the run already holds with the same values are not lost."""
        if "params" not in batch:
            return False
        try:
            held = self._client.result().get_run(self.run_id).data.params
        except Exception:
            return False
        return all(held.get(k) == v for k, v in batch["params"].items())

    def _send(self, batch: dict, synchronous: bool):
        from mlflow.entities import Metric, Param

        client = self._client.result()
        params = [Param(k, v) for k, v in batch.get("params", {}).items()]
        metrics = [Metric(k, float(v), batch["timestamp"], batch["step"])
                   for k, v in batch.get("metrics", {}).items()]
        return client.log_batch(self.run_id, metrics=metrics, params=params,
                                synchronous=synchronous)


def _client(tracking_uri: str | None):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)
