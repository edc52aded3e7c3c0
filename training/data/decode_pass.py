"""Decode many images into store rows on every core.

Large passes run in a process of their own (`python -m training.data.decode_pass`), whose
pool forks worker processes: threads are GIL-bound on PIL's Python header parsing (measured:
processes decode 1.3x faster on 2 cores), a pool forked from a Prefect task process (which
runs threads) can deadlock, and a spawned pool would re-import the caller's main module, such
as Prefect's engine, in every worker. Small passes decode in threads in the caller.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from trainflow_serving.images import Geometry, ImageRejected
from training.data.images import decode_image
from training.data.rows import ARRAY, MARK, file_of

IN_PROCESS_BELOW = 2000  # images: under this, starting processes costs more than it saves
PROGRESS_EVERY = 500


@dataclass(frozen=True)
class WorkItem:
    relpath: str
    data: str
    """The store's data file; the row is written at `row`."""
    side: int
    row: int
    resize: int = 0
    """Geometry.resize: 0 squashes, else the shorter side is resized to it and centre-cropped."""

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.side, self.resize)


@dataclass(frozen=True)
class Outcome:
    ok: bool
    grayscale: bool = False
    reason: str = ""


def workers() -> int:
    return len(os.sched_getaffinity(0))


def decode_all(root: Path, items: list[WorkItem],
               on_progress: Callable[[int, int], None] = lambda done, total: None,
               ) -> list[Outcome]:
    """Decode each item's file into its row; the outcomes in the items' order."""
    copied = copy_array_rows(root, items)
    if copied:
        rest = [item for item in items if item.relpath not in copied]
        decoded = dict(zip((i.relpath for i in rest), decode_all(root, rest), strict=True))
        on_progress(len(items), len(items))
        return [copied.get(item.relpath) or decoded[item.relpath] for item in items]
    if len(items) < IN_PROCESS_BELOW or workers() == 1:
        maps: dict[str, np.ndarray] = {}  # this pass's own: nothing stays mapped after it
        with ThreadPoolExecutor(max_workers=min(8, workers())) as pool:
            return list(_counted(pool.map(lambda item: decode_one(root, item, maps), items),
                                 len(items), on_progress))
    return _in_subprocess(root, items, on_progress)


def copy_array_rows(root: Path, items: list[WorkItem], chunk: int = 8192) -> dict[str, Outcome]:
    """The rows of an array container wanted at the array's own size, copied into the store
    as they are, a chunk at a time: PIL's resize to the same size changes no pixel, so this is
    exactly the per-image decode, without one."""
    groups: dict[tuple[str, str, int], list[WorkItem]] = {}
    for item in items:
        file = file_of(item.relpath)
        if file != item.relpath and file.endswith(ARRAY):
            groups.setdefault((file, item.data, item.side, item.resize), []).append(item)
    outcomes: dict[str, Outcome] = {}
    for (file, data, side, resize), group in groups.items():
        array = np.load(root / file, mmap_mode="r")
        # A square array at the side wanted: squashed or centre-cropped, it is itself.
        if array.shape[1:3] != (side, side) or resize not in (0, side):
            continue
        store = np.memmap(data, dtype=np.uint8, mode="r+").reshape(-1, 3, side, side)
        grayscale = array.ndim == 3
        sources = np.fromiter((i.relpath.rpartition(MARK)[2] for i in group), np.int64,
                              len(group))
        targets = np.fromiter((i.row for i in group), np.int64, len(group))
        for start in range(0, len(group), chunk):
            pixels = array[sources[start:start + chunk]]
            pixels = (np.repeat(pixels[:, None], 3, axis=1) if grayscale
                      else pixels.transpose(0, 3, 1, 2))
            store[targets[start:start + chunk]] = pixels
        store.flush()
        del store
        copied = Outcome(ok=True, grayscale=grayscale)  # frozen: one shared by every row
        outcomes.update((i.relpath, copied) for i in group)
    return outcomes


def decode_one(root: Path, item: WorkItem, maps: dict[str, np.ndarray]) -> Outcome:
    try:
        pixels, grayscale = decode_image(root / item.relpath, item.geometry)
    except ImageRejected as e:
        return Outcome(ok=False, reason=str(e))
    if item.data not in maps:
        rows = os.path.getsize(item.data) // (3 * item.side * item.side)
        maps[item.data] = np.memmap(item.data, dtype=np.uint8, mode="r+",
                                    shape=(rows, 3, item.side, item.side))
    maps[item.data][item.row] = pixels
    return Outcome(ok=True, grayscale=grayscale)


_WORKER_MAPS: dict[str, np.ndarray] = {}  # a worker process's maps, for its one pass


def _decode_in_worker(root: Path, item: WorkItem) -> Outcome:
    return decode_one(root, item, _WORKER_MAPS)


def _counted(outcomes: Iterable[Outcome], total: int,
             on_progress: Callable[[int, int], None]) -> Iterator[Outcome]:
    for done, outcome in enumerate(outcomes, start=1):
        if done % PROGRESS_EVERY == 0 or done == total:
            on_progress(done, total)
        yield outcome


def _in_subprocess(root: Path, items: list[WorkItem],
                   on_progress: Callable[[int, int], None]) -> list[Outcome]:
    from training.processes import tied_to_parent

    with tempfile.TemporaryDirectory(prefix="decode-") as tmp:
        work, results = Path(tmp) / "work.json", Path(tmp) / "outcomes.json"
        errors = Path(tmp) / "stderr.txt"
        work.write_text(json.dumps({"root": str(root), "items": [asdict(i) for i in items]}))
        command = [sys.executable, "-m", "training.data.decode_pass", str(work), str(results)]
        with open(errors, "w") as stderr, subprocess.Popen(
                tied_to_parent(command), stdout=subprocess.PIPE, stderr=stderr, text=True) as proc:
            for line in proc.stdout:
                numbers = line.split()
                if len(numbers) == 2 and all(n.isdigit() for n in numbers):
                    on_progress(int(numbers[0]), int(numbers[1]))
        if proc.returncode != 0:
            tail = errors.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the decoding process failed (exit {proc.returncode}):\n{tail}")
        return [Outcome(**o) for o in json.loads(results.read_text())]


def main(argv: list[str] | None = None) -> None:
    from training.processes import die_with_parent

    work_file, results_file = argv or sys.argv[1:]
    work = json.loads(Path(work_file).read_text())
    root, items = Path(work["root"]), [WorkItem(**i) for i in work["items"]]

    def report(done: int, total: int) -> None:
        print(done, total, flush=True)

    # This process runs no threads, so forking its workers is safe.
    with ProcessPoolExecutor(max_workers=workers(), initializer=die_with_parent,
                             initargs=(signal.SIGKILL,)) as pool:
        chunk = max(1, min(64, len(items) // (workers() * 8)))
        outcomes = list(_counted(pool.map(_decode_in_worker, [root] * len(items), items,
                                          chunksize=chunk), len(items), report))
    Path(results_file).write_text(json.dumps([asdict(o) for o in outcomes]))


if __name__ == "__main__":
    main()
