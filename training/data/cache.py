"""The input pipeline: each image decoded once into the decode store, served as tensors from it.

Decoding JPEGs every epoch is what makes the hand-written tutorial loop slow; here each image
is decoded once per size (by the split stage when the flow runs it, else by the first
training that needs it) into a memory-mapped store (training/data/store.py), and every epoch
and every later run on the same files reads memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from trainflow_serving.images import Geometry
from training.data.split import read_manifest
from training.data.store import DecodeStore, decode_into_stores
from training.handoff import SplitResult


@dataclass(frozen=True)
class SplitImages:
    images: np.ndarray
    """uint8 [R, C, side, side], memory-mapped: the decode store, of which `rows` are this split."""
    rows: np.ndarray
    labels: np.ndarray
    paths: list[str]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array(self.images[self.rows[i]])


def decode_split(data: SplitResult, split: str, side: int | Geometry, channels: int,
                 on_progress: Callable[[int, int], None] = lambda done, total: None,
                 ) -> SplitImages:
    """One split's images at `side`, decoding only what the store does not have yet."""
    rows = [r for r in read_manifest(data.manifest) if r[2] == split]
    index = {name: i for i, name in enumerate(data.class_names)}
    paths = [p for p, _, _ in rows]
    labels = np.array([index[label] for _, label, _ in rows], dtype=np.int64)
    folder = data.manifest.parent.parent
    # A store fetched whole from a remote root holds every row: the images are not here.
    if not data.decoded_only:
        failed = {rel: o.reason for rel, o in
                  decode_into_stores(data.root, {side: paths}, folder, on_progress).items()
                  if not o.ok}
        if failed:
            rel, reason = next(iter(failed.items()))
            raise ValueError(f"{len(failed)} images of the {split} split became unreadable "
                             f"after the split checked them, first {data.root / rel}: {reason}; "
                             "restore them, or run the flow again to re-split")
    store = DecodeStore(folder, side)
    with store.locked(exclusive=False) as stored:
        missing = [p for p in paths if p not in stored["files"]]
        if missing:
            raise ValueError(f"the {store.geometry.name} store of {data.manifest} lacks "
                             f"{len(missing)} images of the {split} split, first {missing[0]}: "
                             "run the flow again (it publishes every store the training reads)")
        found = store.lookup(stored, paths)
    # Memory-mapped: every rank on the host shares the same page cache instead of a copy each.
    # Grayscale datasets are stored with the channel repeated; channel 0 is the image.
    return SplitImages(found.images[:, :channels], found.rows, labels, paths)


class CachedImages(Dataset):
    """uint8 image tensors from the decode store, as stored: augmentation, when training asks
    for it, runs per image where the batch is (training.data.augment)."""

    def __init__(self, images: SplitImages):
        self.images, self.labels = images, images.labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(self.images[i]), int(self.labels[i])
