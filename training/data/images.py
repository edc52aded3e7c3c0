"""Checking and decoding training images; the decoding itself is the served model's own
(trainflow_serving.images), so training sees every image exactly as serving will."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainflow_serving.images import Geometry, ImageRejected, as_geometry
from training.data.rows import open_any


@dataclass(frozen=True)
class ImageCheck:
    path: str
    ok: bool
    grayscale: bool = False
    reason: str = ""


def check_image(root: Path, relpath: str) -> ImageCheck:
    """Decode one image to check it, at the smallest scale that still reads every byte."""
    try:
        # Every compressed byte is still decoded (a truncated JPEG still fails), but a JPEG's
        # pixels only at 1/8 scale: the full-size pixels are the decode store's job.
        _, grayscale = decode_image(root / relpath, side=1)
    except ImageRejected as e:
        return ImageCheck(relpath, ok=False, reason=str(e))
    return ImageCheck(relpath, ok=True, grayscale=grayscale)


def decode_image(path: Path, side: int | Geometry) -> tuple[np.ndarray, bool]:
    """(uint8 [3, side, side], grayscale): the check and the training decode in one pass.

    A grayscale image is decoded as such and its channel repeated, which is exactly what
    converting it to RGB first would give; channel 0 is its 1-channel decode.
    """
    geometry = as_geometry(side)
    img = geometry.apply(open_any(path, None, draft=geometry.draft))
    pixels = np.asarray(img, dtype=np.uint8)
    if img.mode == "L":
        return np.repeat(pixels[None], 3, axis=0), True
    return pixels.transpose(2, 0, 1), False
