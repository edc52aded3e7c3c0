"""Real servers for tests, each on 127.0.0.1 and a free port, always stopped afterwards."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from commands.services import wait_http
from training.processes import free_port, kill_tree

BIN = Path(sys.executable).parent


@contextlib.contextmanager
def started(command: list[str], url: str, log: Path, env: dict | None = None,
            timeout: float = 120) -> Iterator[subprocess.Popen]:
    with open(log, "ab") as out:
        # Servers exec helpers (uvicorn, gunicorn) by name: this environment's bin comes first.
        path = os.pathsep.join([str(BIN), os.environ.get("PATH", "")])
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PATH": path, **(env or {})},
                                start_new_session=True)
    try:
        wait_http(url, timeout, proc)
        yield proc
    finally:
        kill_tree(proc)


@contextlib.contextmanager
def mlflow_server(folder: Path, port: int | None = None) -> Iterator[str]:
    """An MLflow server on `folder`'s store; the same folder and port again is a restart."""
    folder.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    command = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
               "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
               "--artifacts-destination", str(folder / "artifacts"), "--workers", "1"]
    url = f"http://127.0.0.1:{port}"
    with started(command, f"{url}/health", folder / "mlflow.log"):
        yield url
