"""One local Prefect server for hand-started flows, started once and reused.

A flow called with no PREFECT_API_URL would make Prefect start a temporary server for that one
run: 7-20 s each time, and on a busy machine it misses Prefect's 20 s start-up limit and the run
dies before doing anything. Prefect itself points to a dedicated server instead. So a
hand-started flow (the CLI: `trainflow train`, `trainflow sweep`, `make demo`) uses PREFECT_API_URL when it is
set; otherwise the server recorded in $PREFECT_HOME/trainflow-server.json when it still
answers; otherwise it starts one there in the background (port 4200, or a free one when 4200 is
taken), waits for it as long as it needs, and records it. Its UI lists every hand-started run.
`trainflow services stop` (make stop) ends it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from training.processes import alive

BIN = Path(sys.executable).parent
PORT = 4200
START_TIMEOUT_S = 600


def prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()


def record_file() -> Path:
    return prefect_home() / "trainflow-server.json"


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=3):
            return True
    except OSError:
        return False


def running() -> dict | None:
    """The recorded server, if its process is alive and it answers."""
    try:
        record = json.loads(record_file().read_text())
    except (OSError, ValueError):
        return None
    if alive(record["pid"]) and answers(record["url"]):
        return record
    return None


def _port() -> int:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", PORT))
            return PORT
        except OSError:  # 4200 taken (another home's server, say): any free port
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


def start(say=lambda text: print(text, file=sys.stderr, flush=True)) -> dict:
    """Start the server in the background, wait until it answers, record it."""
    home = prefect_home()
    home.mkdir(parents=True, exist_ok=True)
    port = _port()
    url = f"http://127.0.0.1:{port}/api"
    log = home / "trainflow-server.log"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "PREFECT_SERVER_ANALYTICS_ENABLED": os.environ.get(
               "PREFECT_SERVER_ANALYTICS_ENABLED", "false")}
    env.pop("PREFECT_API_URL", None)
    with open(log, "ab") as out:
        # A session of its own: the server outlives this run and is reused by the next.
        proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    say(f"starting a local Prefect server on {url} (once; later runs reuse it; "
        f"`trainflow services stop` ends it), log {log}")
    started = time.monotonic()
    said = started
    while not answers(url):
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-1500:]
            raise RuntimeError(
                f"the local Prefect server exited ({proc.returncode}) before answering on port "
                f"{port}. Its log ends:\n{tail}\nIf the port is taken or the database is "
                f"locked, stop what holds it (`trainflow services stop`), or point "
                "PREFECT_API_URL at a running server.")
        if time.monotonic() - started > START_TIMEOUT_S:
            stop_process(proc.pid)
            raise RuntimeError(f"the local Prefect server did not answer within "
                               f"{START_TIMEOUT_S} s; see {log}")
        if time.monotonic() - said >= 5:
            said = time.monotonic()
            say(f"  waiting for the Prefect server ({said - started:.0f} s)")
        time.sleep(0.3)
    record = {"pid": proc.pid, "url": url, "log": str(log)}
    record_file().write_text(json.dumps(record))
    say(f"local Prefect server ready in {time.monotonic() - started:.1f} s: UI "
        f"{url.removesuffix('/api')}")
    return record


@contextlib.contextmanager
def local_prefect_api() -> Iterator[str]:
    """PREFECT_API_URL if set, else the reused local server, for the enclosed flow calls."""
    if url := os.environ.get("PREFECT_API_URL"):
        yield url
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    record = running() or start()
    os.environ["PREFECT_API_URL"] = record["url"]  # child processes (the ranks) agree
    try:
        with temporary_settings({PREFECT_API_URL: record["url"]}):
            yield record["url"]
    finally:
        os.environ.pop("PREFECT_API_URL", None)


def stop_process(pid: int, grace_s: float = 15) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(os.getpgid(pid), signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if alive(pid):
            os.killpg(os.getpgid(pid), signal.SIGKILL)


def stop() -> str | None:
    """End the recorded local server; what was stopped, or None."""
    try:
        record = json.loads(record_file().read_text())
    except (OSError, ValueError):
        return None
    stopped = None
    if alive(record["pid"]):
        stop_process(record["pid"])
        stopped = f"stopped the local Prefect server (pid {record['pid']}, {record['url']})"
    record_file().unlink(missing_ok=True)
    return stopped
