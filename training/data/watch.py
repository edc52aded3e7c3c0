"""What changed in a folder source since a baseline, from file lists and sizes only.

The watch must cost far less than the decode pass it may start, so it reads no image: a file
counts as changed when its label, size or modification time differs. `prepare_dataset` still
hashes every file's content when the run it starts begins (training/data/sources.py).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pydantic import BaseModel

from training.config import DatasetSpec
from training.data.labels import list_labelled_files

Listing = dict[str, tuple[str, int, int]]
"""path relative to the images' folder -> (label, size in bytes, mtime in ns)"""


class Changes(BaseModel):
    """Images new, changed or removed since the baseline, by class."""

    new: dict[str, int] = {}
    changed: dict[str, int] = {}
    """relabelled, or rewritten in place (another size or modification time)"""
    removed: dict[str, int] = {}
    images: int
    """labelled images in the folder now"""

    @property
    def new_or_changed(self) -> int:
        return sum(self.new.values()) + sum(self.changed.values())

    @property
    def any(self) -> bool:
        return bool(self.new or self.changed or self.removed)


def watchable(spec: DatasetSpec) -> bool:
    """Only a folder changes in place; the other sources are pinned (built-in, torchvision,
    Hugging Face) or change by version, which the run's own prepare step checks (Kaggle)."""
    return spec.kind == "local"


def listing(spec: DatasetSpec) -> Listing:
    """Every labelled image of a folder source, as the training would read it."""
    root = Path(spec.source).expanduser().resolve()
    images_root = root / spec.subdir if spec.subdir else root
    found = {}
    for path, label in list_labelled_files(images_root, spec.labels, root):
        stat = (images_root / path).stat()
        found[path] = (label, stat.st_size, stat.st_mtime_ns)
    return found


def compare(before: Listing, after: Listing) -> Changes:
    new, changed, removed = Counter(), Counter(), Counter()
    for path, (label, size, mtime) in after.items():
        was = before.get(path)
        if was is None:
            new[label] += 1
        elif tuple(was) != (label, size, mtime):
            changed[label] += 1
    for path, (label, *_) in before.items():
        if path not in after:
            removed[label] += 1
    return Changes(new=dict(sorted(new.items())), changed=dict(sorted(changed.items())),
                   removed=dict(sorted(removed.items())), images=len(after))
