"""Decoded images, one decode per file: a memory-mapped uint8 store per image geometry.

    <split folder>/decoded/<side>px/          (squashed to side x side)
    <split folder>/decoded/<side>px-of-<r>/   (shorter side to r, centre side x side crop)
        index.json      {"data": "images-<n>.u8", "rows": R,
                         "files": {relpath: [row, size, mtime_ns, grayscale]}}
        images-<n>.u8   R rows of uint8 [3, side, side], raw, memory-mapped

A file is decoded when its path is new to the store or its size or modification time
changed; a dataset that grew decodes only its new files, and every dataset version reads the
same rows. Rows are only ever appended, so a training that mapped the store keeps valid rows
while another run adds to it. Grayscale images are stored with their channel repeated; a
1-channel reader takes channel 0 (see images.decode_image).

The index is the store's only record of what is in it: a run killed while decoding leaves
rows past the index's count, which the next run overwrites.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainflow_serving.images import Geometry, as_geometry
from training.data.decode_pass import Outcome, WorkItem, decode_all
from training.data.rows import file_of
from training.storage import file_lock, write_json_atomic

CHANNELS = 3
KEPT_SIDES = 4  # stores per split folder: a training with augmentation uses two sides


@dataclass(frozen=True)
class Decoded:
    """The rows of some files in a store, in the order they were asked for."""

    images: np.ndarray
    """uint8 [R, 3, side, side], memory-mapped: the whole store."""
    rows: np.ndarray
    """int64 [N]: the row of each file."""
    grayscale: list[bool]


DECODER = 2
"""Bumped whenever decoding changes what a file's pixels are (2: EXIF orientation applied)."""


class DecodeStore:
    def __init__(self, split_folder: Path, side: int | Geometry):
        self.geometry = as_geometry(side)
        self.side = self.geometry.side
        self.folder = split_folder / "decoded" / self.geometry.name
        self.index_path = self.folder / "index.json"

    @property
    def row_bytes(self) -> int:
        return CHANNELS * self.side * self.side

    @contextlib.contextmanager
    def locked(self, exclusive: bool) -> Iterator[dict]:
        """The index, read under a lock: one writer at a time, readers never see a partial one."""
        with file_lock(self.folder / "lock", exclusive):
            yield self._read_index()

    def _read_index(self) -> dict:
        if self.index_path.is_file():
            index = json.loads(self.index_path.read_text())
            if index.get("decoder") != DECODER:
                # Rows an older decoder wrote (before EXIF orientation) are decoded again into
                # new rows; compaction reclaims the old ones.
                index = {**index, "files": {}, "decoder": DECODER}
            return index
        return {"data": "images-0.u8", "rows": 0, "files": {}, "decoder": DECODER}

    def pending(self, index: dict, root: Path, relpaths: list[str]) -> list[str]:
        """The files the store has no current row for (new, or changed since decoded)."""
        files, identity = index["files"], Identities(root)
        return [rel for rel in relpaths if (entry := files.get(rel)) is None
                or entry[1:3] != identity(rel)]

    def map(self, index: dict) -> np.ndarray:
        data = self.folder / index["data"]
        if index["rows"] == 0:
            return np.empty((0, CHANNELS, self.side, self.side), dtype=np.uint8)
        return np.memmap(data, dtype=np.uint8, mode="r",
                         shape=(index["rows"], CHANNELS, self.side, self.side))

    def touch(self) -> None:
        """Mark the store as used now: the least recently used stores are pruned first."""
        os.utime(self.index_path)

    def lookup(self, index: dict, relpaths: list[str]) -> Decoded:
        entries = [index["files"][rel] for rel in relpaths]
        return Decoded(self.map(index), np.array([e[0] for e in entries], dtype=np.int64),
                       [bool(e[3]) for e in entries])


def decode_into_stores(root: Path, wanted: dict[Geometry, list[str]], split_folder: Path,
                       on_progress: Callable[[int, int], None] = lambda done, total: None,
                       ) -> dict[str, Outcome]:
    """Make sure each store in `wanted` (by geometry; an int is a squashed side) has a current
    row for each of its files.

    Everything missing, over all sides, is decoded in one pass over every core. Returns what
    each decoded file turned out to be (ok and grayscale, or the reason it is unusable);
    files that were already in their stores are not in it.
    """
    wanted = {as_geometry(side): files for side, files in wanted.items()}
    stores = {side: DecodeStore(split_folder, side) for side in sorted(wanted)}
    with contextlib.ExitStack() as held:
        indexes = {side: held.enter_context(store.locked(exclusive=True))
                   for side, store in stores.items()}
        items: list[WorkItem] = []
        for side, store in stores.items():
            index = indexes[side]
            todo = store.pending(index, root, wanted[side])
            if not todo:
                continue
            data = _extend(store, index, len(todo))
            items += [WorkItem(rel, str(data), side.side, index["rows"] + i, side.resize)
                      for i, rel in enumerate(todo)]
        outcomes = decode_all(root, items, on_progress) if items else []
        by_side: dict[Geometry, list[tuple[WorkItem, Outcome]]] = {}
        identity = Identities(root)
        for item, outcome in zip(items, outcomes, strict=True):
            by_side.setdefault(item.geometry, []).append((item, outcome))
        for side, done in by_side.items():
            index, files = indexes[side], indexes[side]["files"]
            for item, outcome in done:
                if outcome.ok:
                    files[item.relpath] = [item.row, *identity(item.relpath), outcome.grayscale]
                else:
                    files.pop(item.relpath, None)
            index["rows"] = max(item.row for item, _ in done) + 1
            write_json_atomic(stores[side].index_path, index, compact=True)
        for store in stores.values():
            if store.index_path.is_file():
                store.touch()
    return {item.relpath: outcome for item, outcome in zip(items, outcomes, strict=True)}


def _extend(store: DecodeStore, index: dict, rows: int) -> Path:
    """The store's data file, with room reserved for `rows` more rows after the index's count.

    The space is allocated now, not on first write: a full disk is a clear error here rather
    than a SIGBUS in a decoding process halfway through.
    """
    data = store.folder / index["data"]
    size = (index["rows"] + rows) * store.row_bytes
    with open(data, "ab") as f:
        f.truncate(index["rows"] * store.row_bytes)
        try:
            os.posix_fallocate(f.fileno(), 0, size)
        except OSError as e:
            if e.errno != errno.ENOSPC:  # a filesystem that cannot reserve: grow it sparse
                f.truncate(size)
                return data
            f.truncate(index["rows"] * store.row_bytes)
            free = shutil.disk_usage(store.folder).free
            raise OSError(
                f"decoding {rows} images at {store.side} px needs {size / 1e6:,.0f} MB in "
                f"{store.folder} ({free / 1e6:,.0f} MB free): free space, or set "
                f"TRAINFLOW_HOME to a larger disk ({e})"
            ) from e
    return data


class Identities:
    """[size, mtime_ns] of the file behind each path, statted once per file: a row is as
    current as its container, and 70,000 rows share one."""

    def __init__(self, root: Path):
        self.root, self.known = root, {}

    def __call__(self, relpath: str) -> list[int]:
        file = file_of(relpath)
        if file not in self.known:
            stat = (self.root / file).stat()
            self.known[file] = [stat.st_size, stat.st_mtime_ns]
        return self.known[file]


def compact(store: DecodeStore, keep: set[str]) -> int:
    """Drop the store's files not in `keep`; rewrite its data once most rows are dead.

    A rewrite goes to a new data file named in the index: a training that mapped the old file
    keeps reading it until it ends (the file's space is freed then).
    """
    with store.locked(exclusive=True) as index:
        files = {rel: entry for rel, entry in index["files"].items() if rel in keep}
        dead = index["rows"] - len(files)
        if len(files) == len(index["files"]) and dead <= len(files):
            return 0
        if dead > len(files):
            old = store.map(index)
            generation = int(index["data"].removeprefix("images-").removesuffix(".u8")) + 1
            data = store.folder / f"images-{generation}.u8"
            rows = np.memmap(data, dtype=np.uint8, mode="w+",
                             shape=(max(len(files), 1), CHANNELS, store.side, store.side))
            for new_row, (rel, entry) in enumerate(sorted(files.items(), key=lambda f: f[1][0])):
                rows[new_row] = old[entry[0]]
                files[rel] = [new_row, *entry[1:]]
            rows.flush()
            del rows, old
            stale = store.folder / index["data"]
            index = {"data": data.name, "rows": len(files), "files": files}
            write_json_atomic(store.index_path, index, compact=True)
            stale.unlink(missing_ok=True)
        else:
            write_json_atomic(store.index_path, {**index, "files": files}, compact=True)
        return dead


def prune_stores(split_folder: Path, kept: int = KEPT_SIDES) -> list[Path]:
    """Remove all but the `kept` most recently used stores of a split folder."""
    indexes = sorted(split_folder.glob("decoded/*/index.json"),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    removed = [p.parent for p in indexes[kept:]]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def store_bytes(split_folder: Path) -> int:
    return sum(p.stat().st_size for p in split_folder.glob("decoded/*/images-*.u8"))
