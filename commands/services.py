"""Local services for deployments: Prefect server, MLflow server and a process worker.

    trainflow services start --folder .services     # (make services)
    trainflow services start --stack production     # PostgreSQL, S3, MLflow basic-auth too
    trainflow services stop --folder .services      # (make stop)

Everything binds to 127.0.0.1. Process ids go to <folder>/<name>.pid and logs to
<folder>/<name>.log; `stop` ends exactly the processes it recorded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from commands import work_pool
from training.processes import alive
from training.storage import home

BIN = Path(sys.executable).parent
POOL = "train-pool"
POOL_LIMIT = 2
"""Flow runs the local pool runs at once: each training takes every core of a machine, so a
few queued runs must wait rather than all start together (prefect.yaml sets each deployment's
own limit below this)."""


STOP_SIGNALS = {"postgres": signal.SIGINT}
"""PostgreSQL's SIGTERM waits for every client to leave; SIGINT is its fast, clean shutdown."""


def as_user(user: str | None) -> dict:
    """Popen's arguments to run as `user` with its own group only (root's would stay)."""
    return {"user": user, "group": user, "extra_groups": []} if user else {}


def start_process(name: str, command: list[str], folder: Path, env: dict[str, str],
                  user: str | None = None) -> bool:
    """Start `name` in the background unless its recorded process still runs; True if started."""
    pid_file = folder / f"{name}.pid"
    if pid_file.exists() and alive(int(pid_file.read_text())):
        print(f"{name} already running (pid {pid_file.read_text().strip()})")
        return False
    log_file = folder / f"{name}.log"
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, **as_user(user))
    pid_file.write_text(str(proc.pid))
    print(f"started {name} (pid {proc.pid}), log {log_file}")
    return True


def wait_http(url: str, timeout: float = 120, proc: subprocess.Popen | None = None) -> None:
    """Wait until `url` answers; fail early if the server process `proc` has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s; see the logs")


def services_env(prefect_port: int, mlflow_port: int, extra: dict | None = None) -> dict:
    """The environment in which the services, `prefect deploy` and the flow runs agree."""
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
            "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            # Notice a cancelled flow run in seconds even when the event stream is quiet, so
            # that training ranks stop holding GPUs soon after the user cancels.
            "PREFECT_WORKER_CANCELLATION_POLL_SECONDS": "2",
            # Prefect's default 10 s between polls is up to 10 s of waiting on every
            # `prefect deployment run`; polling a server on the same machine costs nothing.
            "PREFECT_WORKER_QUERY_SECONDS": os.environ.get("PREFECT_WORKER_QUERY_SECONDS", "2"),
            # A scheduled run that starts while MLflow restarts waits for it (tasks/preflight.py).
            "TRAINFLOW_MLFLOW_WAIT_S": "60", **work_pool.HEARTBEAT_ENV, **(extra or {})}


def start(folder: Path, prefect_port: int, mlflow_port: int, pool: str = POOL,
          extra_env: dict | None = None) -> dict:
    """Start the three services (or keep those already running); return their environment."""
    folder.mkdir(parents=True, exist_ok=True)
    env = services_env(prefect_port, mlflow_port, extra_env)
    prefect_url, mlflow_url = env["PREFECT_API_URL"], env["MLFLOW_TRACKING_URI"]
    store = Path(env.get("TRAINFLOW_HOME") or home()).expanduser() / "mlflow-server"
    store.mkdir(parents=True, exist_ok=True)
    start_process("prefect-server", [str(BIN / "prefect"), "server", "start", "--host",
                                     "127.0.0.1", "--port", str(prefect_port)], folder, env)
    start_process("mlflow-server", [str(BIN / "mlflow"), "server", "--host", "127.0.0.1",
                                    "--port", str(mlflow_port), "--backend-store-uri",
                                    f"sqlite:///{store / 'mlflow.db'}", "--artifacts-destination",
                                    str(store / "artifacts")], folder, env)
    wait_http(f"{prefect_url}/health")
    wait_http(f"{mlflow_url}/health")
    work_pool.create(pool, env, limit=POOL_LIMIT)
    start_process("worker", [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type",
                             "process"], folder, env)
    print(f"\nPrefect UI  http://127.0.0.1:{prefect_port}\nMLflow UI   {mlflow_url}\n"
          f"Use them from this shell:\n  export PREFECT_API_URL={prefect_url} "
          f"MLFLOW_TRACKING_URI={mlflow_url}")
    return env


def stop(folder: Path) -> None:
    """End what `start` recorded, last started first: the databases outlive their clients."""
    for pid_file in sorted(folder.glob("*.pid"), key=lambda p: p.stat().st_mtime, reverse=True):
        pid = int(pid_file.read_text())
        if alive(pid):
            os.killpg(os.getpgid(pid), STOP_SIGNALS.get(pid_file.stem, signal.SIGTERM))
            deadline = time.monotonic() + 15
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if alive(pid):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            print(f"stopped {pid_file.stem} (pid {pid})")
        pid_file.unlink()
