"""The input pipeline: decode each image once into a uint8 cache, then serve tensors from it.

Decoding JPEGs every epoch is what makes the hand-written tutorial loop slow; here the first
run decodes each split once (threads, JPEG draft mode) into a .npy file next to the manifest,
and every epoch after that (and every later run on the same data) reads memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

from training.data.images import load_resized
from training.data.split import read_manifest
from training.handoff import SplitResult
from training.storage import atomic_path

# Random crops are cut from a slightly larger image, as ImageNet training does (256 -> 224).
CROP_MARGIN = 8 / 7
CROP_SCALE = (0.7, 1.0)


def cache_side(image_size: int, augment: bool) -> int:
    """The cached side: a margin to crop from when augmenting, else the input size itself."""
    return round(image_size * CROP_MARGIN) if augment else image_size


def decode_split(data: SplitResult, split: str, side: int, channels: int,
                 on_progress: Callable[[int, int], None] = lambda done, total: None,
                 ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(images uint8 [N, C, side, side], labels int64 [N], paths) for one split, cached on disk."""
    rows = [r for r in read_manifest(data.manifest) if r[2] == split]
    index = {name: i for i, name in enumerate(data.class_names)}
    paths = [p for p, _, _ in rows]
    labels = np.array([index[label] for _, label, _ in rows], dtype=np.int64)
    root, cache_dir = data.root, data.manifest.parent / "cache"
    key = data.manifest_sha256[:16]
    cache = cache_dir / f"{split}-{side}px-{channels}ch-{key}.npy"
    if not cache.is_file():
        images = np.empty((len(rows), channels, side, side), dtype=np.uint8)

        def load(i: int) -> None:
            images[i] = load_resized(root / paths[i], side, channels)

        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            for done, _ in enumerate(pool.map(load, range(len(rows))), start=1):
                if done % 500 == 0:  # a heartbeat, so a long decode is not taken for a hang
                    on_progress(done, len(rows))
        with atomic_path(cache) as tmp, open(tmp, "wb") as f:
            np.save(f, images)
    # Memory-mapped: every rank on the host shares the same page cache instead of a copy each.
    return np.load(cache, mmap_mode="r"), labels, paths


class CachedImages(Dataset):
    """uint8 image tensors from the decode cache, augmented as TrainingSpec.augment says."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, image_size: int,
                 augment: str | bool = "none"):
        self.images, self.labels = images, labels
        augment = {True: "crop_flip", False: "none"}.get(augment, augment)
        steps = []
        if augment in ("crop", "crop_flip"):
            # Mild: heavy crops (down to 8% as in ImageNet, or 50%) cost short trainings accuracy.
            steps.append(v2.RandomResizedCrop(image_size, scale=CROP_SCALE, antialias=True))
        if augment == "crop_flip":
            steps.append(v2.RandomHorizontalFlip())
        self.transform = v2.Compose(steps) if steps else None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = torch.from_numpy(np.array(self.images[i]))
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[i])


class Normalize(torch.nn.Module):
    """uint8 batch -> normalised float batch, on whatever device the batch is on."""

    def __init__(self, mean: list[float], std: list[float]):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1) * 255)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1) * 255)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return (batch.float() - self.mean) / self.std
