"""Images that are rows of one file, not files of their own: the tables of array-backed sources
(torchvision's MNIST or CIFAR, a Hugging Face dataset's parquet).

A row's path is `<split>/<container>#<row>`, e.g. `test/images.npy#0000042`, so the manifest,
the split ledger and the decode store address it like any image file. Three containers:

    images.npy          uint8 [N, H, W] or [N, H, W, 3], memory-mapped (decoded arrays)
    images.bin          encoded images back to back; images.offsets.npy int64 [N + 1]
    files.txt           one image file per line, absolute (a catalogue's own files)

A row opens as the PIL image a file would, and gives encoded bytes where a file's would be
read (the served model scores bytes): PNG for an array row, lossless, so serving decodes
exactly the pixels training saw.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path

import numpy as np
from PIL import Image

from trainflow_serving.images import ImageRejected, open_image

MARK = "#"
ARRAY, ENCODED, FILES = "images.npy", "images.bin", "files.txt"
CONTAINERS = (ARRAY, ENCODED, FILES)
_opened: dict[tuple[str, int], object] = {}
_lock = threading.Lock()


def row_path(split: str, container: str, row: int) -> str:
    return f"{split}/{container}{MARK}{row:07d}"


def is_row(path: Path | str) -> bool:
    """A row of one of our containers; an image file may have "#" in its name too."""
    # String operations: this runs for every row of a 70,000-row table, several times.
    name = path.name if isinstance(path, Path) else path.rpartition("/")[2]
    container, mark, row = name.partition(MARK)
    return bool(mark) and container in CONTAINERS and row.isdigit()


def file_of(relpath: str) -> str:
    """The file behind a path: a row's container, or the image file itself."""
    return relpath.partition(MARK)[0] if MARK in relpath and is_row(relpath) else relpath


def _row(path: Path) -> tuple[Path, int]:
    name, _, row = path.name.partition(MARK)
    return path.with_name(name), int(row)


def _open(container: Path):
    """The container, opened once per process and version of the file."""
    key = (str(container), container.stat().st_mtime_ns)
    with _lock:
        if key not in _opened:
            if container.name == ARRAY:
                _opened[key] = np.load(container, mmap_mode="r")
            elif container.name == ENCODED:
                _opened[key] = (np.memmap(container, dtype=np.uint8, mode="r")
                                if container.stat().st_size else np.empty(0, np.uint8),
                                np.load(container.with_name("images.offsets.npy")))
            elif container.name == FILES:
                _opened[key] = container.read_text(encoding="utf-8").splitlines()
            else:
                raise ImageRejected(f"{container.name} is not a row container")
        return _opened[key]


def open_row(path: Path, channels: int | None, draft: tuple[int, int] | None = None
             ) -> Image.Image:
    try:
        container, row = _row(path)
        held = _open(container)
    except (OSError, ValueError) as e:
        raise ImageRejected(f"cannot read row {path.name}: {e}") from e
    if container.name == ARRAY:
        image = Image.fromarray(np.ascontiguousarray(held[row]))
        if channels is None:
            channels = 1 if image.mode == "L" else 3
        return image.convert("L" if channels == 1 else "RGB")
    if container.name == ENCODED:
        data, offsets = held
        return open_image(io.BytesIO(data[offsets[row]:offsets[row + 1]].tobytes()),
                          channels, draft)
    return open_image(Path(held[row]), channels, draft)


def row_bytes(path: Path) -> bytes:
    """A row as an encoded image."""
    container, row = _row(path)
    held = _open(container)
    if container.name == ENCODED:
        data, offsets = held
        return data[offsets[row]:offsets[row + 1]].tobytes()
    if container.name == FILES:
        return Path(held[row]).read_bytes()
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(held[row])).save(buffer, format="PNG")
    return buffer.getvalue()


def image_bytes(path: Path | str) -> bytes:
    """A file's bytes, or a row's as an encoded image."""
    path = Path(path)
    return row_bytes(path) if is_row(path) else path.read_bytes()


def open_any(path: Path, channels: int | None, draft: tuple[int, int] | None = None
             ) -> Image.Image:
    return open_row(path, channels, draft) if is_row(path) else open_image(path, channels, draft)
