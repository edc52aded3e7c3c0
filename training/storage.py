"""Where a run writes, and how it writes without leaving half-written files behind."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def home() -> Path:
    """The one folder that holds datasets, manifests, run folders and the default MLflow store."""
    return Path(os.environ.get("TRAINFLOW_HOME") or "~/.trainflow").expanduser().resolve()


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, or a SQLite file in the home so that the demo needs no server."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home() / 'mlflow.db'}"


def redacted(uri: str) -> str:
    """`uri` with any password replaced by ***, for messages and logs (a database tracking URI
    carries one)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if not parts.password:
        return uri
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))  # namedtuple API


@contextlib.contextmanager
def file_lock(path: Path, exclusive: bool = True) -> Iterator[None]:
    """The home's one lock: an advisory lock (flock) on `path`, held for the block. Whoever
    writes a shared thing holds it exclusively and checks again, under it, whether another
    process already wrote it; readers of a thing that changes in place hold it shared. The
    kernel releases it when a process dies, so a killed writer never leaves it held.

    Its users, each with a lock file beside what it guards: a built-in or copied dataset
    (training/data/sources.py), a Kaggle version's download (kaggle.py), torchvision and Hugging
    Face tables (tables.py), a split folder and its ledger (split.py), a decode store
    (store.py), the gate's cached champion predictions (tasks/gate.py). What lives on a server
    (an MLflow experiment, a Prefect concurrency limit) is created once and read back when a
    concurrent creator won (tasks/tracking.py, tasks/gate.py). tests/test_fresh_home.py and
    test_e2e.py's fresh-home test start first runs at the same instant."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside `final`; rename it into place only if the block succeeds.

    A crash or kill mid-write leaves at most a stray temporary file, never a truncated file
    under the final name (rename is atomic on one filesystem).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, final)
    finally:
        tmp_path.unlink(missing_ok=True)


def write_text_atomic(final: Path, text: str) -> None:
    with atomic_path(final) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(final: Path, data: Any, compact: bool = False) -> None:
    """Indented for people; `compact` for a machine's files of many entries (a decode store's
    index, a split's ledger: 70,000 rows for MNIST), which indenting makes several times slower."""
    text = (json.dumps(data, separators=(",", ":"), sort_keys=True, default=str) if compact
            else json.dumps(data, indent=2, sort_keys=True, default=str))
    write_text_atomic(final, text + "\n")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
