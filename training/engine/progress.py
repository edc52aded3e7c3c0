"""The structured channel from the training processes to whoever launched them.

Each rank appends its messages (training/engine/events.py) as JSON lines to its own file,
`progress/rank<N>.jsonl`, flushed per line: the task tails them for epoch metrics, heartbeats
(the hang watchdog) and per-rank errors, instead of scraping free text.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from training.engine.events import Event, Failed, Started, parse_event

TASK_REPORTS = "TRAINFLOW_TASK_REPORTS"
"""Set by the launching task, which shows each epoch and a failed rank's traceback once, from the
ranks' events: the ranks then print neither themselves."""


def task_reports() -> bool:
    import os

    return bool(os.environ.get(TASK_REPORTS))


def progress_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "progress"


@dataclass(frozen=True)
class Rank:
    """Who this process is, decided once from the Accelerator and passed to whoever needs it."""

    index: int
    world: int
    main: bool

    @classmethod
    def of(cls, accelerator) -> Rank:
        return cls(accelerator.process_index, accelerator.num_processes,
                   accelerator.is_main_process)


class ProgressWriter:
    def __init__(self, output_dir: Path, rank: int):
        folder = progress_dir(output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._lock = threading.Lock()  # the MLflow logger thread reports errors here too
        # Held open for the whole run; line-buffered so every event is on disk when written.
        self._file = open(folder / f"rank{rank}.jsonl", "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def emit(self, kind: type[Event], **fields: Any) -> None:
        """Send a `kind` message (training/engine/events.py) from this rank, now; a field the
        model does not have fails here, in the rank that wrote it."""
        record = kind(rank=self.rank, time=time.time(), **fields)
        with self._lock:
            self._file.write(record.model_dump_json() + "\n")

    def close(self) -> None:
        self._file.close()

    @contextlib.contextmanager
    def reporting_errors(self) -> Iterator[None]:
        """An exception becomes this rank's `error` event (with its traceback), then goes on; under
        a task that reports it, the rank exits with code 1 without printing it a second time."""
        try:
            yield
        except Exception as e:
            self.emit(Failed, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            if task_reports():
                raise SystemExit(1) from None
            raise


class MalformedEvent(ValueError):
    """A line in a rank's progress file that is not one of the messages of events.py."""


def _parse(path: Path, line: bytes) -> Event:
    try:
        return parse_event(line)
    except ValidationError as e:
        problem = e.errors()[0]
        where = ".".join(map(str, problem["loc"]))
        raise MalformedEvent(
            f"{path.stem.replace('rank', 'rank ')} sent a message the task cannot read "
            f"({where + ': ' if where else ''}{problem['msg']}): {line[:200]!r}; the ranks and "
            "the task must run the same version of training/") from None


def start_rank(accelerator, output_dir: Path) -> tuple[Rank, ProgressWriter]:
    """Who this process is (decided once, then passed on) and its channel, opened with the
    `start` event that tells the launcher the rank is up."""
    import os

    import torch

    rank = Rank.of(accelerator)
    progress = ProgressWriter(output_dir, rank.index)
    progress.emit(Started, world_size=rank.world, device=str(accelerator.device),
                  pid=os.getpid(), threads=torch.get_num_threads(),
                  address=os.environ.get("PET_LOCAL_ADDR"))
    return rank, progress


class ProgressReader:
    """Reads new complete lines from every rank's file; a partial last line waits for its end."""

    def __init__(self, output_dir: Path):
        self.folder = progress_dir(output_dir)
        self._offsets: dict[Path, int] = {}

    def skip_existing(self) -> None:
        """Ignore events from earlier attempts (a retry appends to the same files)."""
        for path in sorted(self.folder.glob("rank*.jsonl")):
            self._offsets[path] = path.stat().st_size

    def poll(self) -> list[Event]:
        events = []
        for path in sorted(self.folder.glob("rank*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = offset + end
            for line in data[:end].splitlines():
                if line.strip():
                    events.append(_parse(path, line))
        return sorted(events, key=lambda e: e.time)
