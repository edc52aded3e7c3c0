"""Decoding images once, fully, with limits: the only code that opens image files, for
training, evaluation and serving alike."""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
# 40 megapixels: far above any training photo, far below what exhausts memory when decoded.
MAX_PIXELS = 40_000_000
GRAYSCALE_MODES = frozenset({"1", "L", "LA", "I", "I;16", "F"})
ORIENTATION = 0x0112  # the EXIF tag


class ImageRejected(ValueError):
    """The file cannot be used as an image; the message says why."""


def open_image(path: Path | BinaryIO, channels: int | None,
               draft: tuple[int, int] | None = None) -> Image.Image:
    """Open and fully decode an image (a file, or encoded bytes in a file object), converted to
    1 (L) or 3 (RGB) channels; `None`: 1 for a grayscale image, else 3.

    `verify()` alone accepts truncated JPEGs that later crash a DataLoader mid-epoch, so
    the pixels are always decoded here.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                width, height = img.size
                if width * height > MAX_PIXELS:
                    raise ImageRejected(
                        f"{width}x{height} pixels is over the {MAX_PIXELS:,}-pixel limit "
                        "(possible decompression bomb)"
                    )
                if channels is None:
                    channels = 1 if is_grayscale(img) else 3
                if draft is not None:
                    # JPEG only: decode at a reduced DCT scale no smaller than `draft`; far
                    # cheaper than decoding full size and resizing.
                    img.draft("L" if channels == 1 else "RGB", draft)
                img.load()
                # A camera's photo stored sideways with an orientation tag is shown upright by
                # every viewer: train, evaluate and serve it upright too. Untagged: untouched.
                if img.getexif().get(ORIENTATION, 1) != 1:
                    img = ImageOps.exif_transpose(img)
                return img.convert("L" if channels == 1 else "RGB")
    except ImageRejected:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageRejected(f"refused by size: {e}") from e
    except UnidentifiedImageError as e:
        raise ImageRejected("not an image file") from e
    except (OSError, SyntaxError, ValueError) as e:
        reason = "empty file" if _is_empty(path) else f"cannot decode: {e}"
        raise ImageRejected(reason) from e


def _is_empty(source: Path | BinaryIO) -> bool:
    if hasattr(source, "getbuffer"):
        return source.getbuffer().nbytes == 0
    return Path(source).stat().st_size == 0


def is_grayscale(img: Image.Image) -> bool:
    return img.mode in GRAYSCALE_MODES or (img.mode == "P" and _palette_is_gray(img))


def _palette_is_gray(img: Image.Image) -> bool:
    palette = img.getpalette() or []
    triples = zip(palette[0::3], palette[1::3], palette[2::3], strict=False)
    return all(r == g == b for r, g, b in triples)


@dataclass(frozen=True, order=True)
class Geometry:
    """How a decoded image becomes a square of `side` pixels.

    `resize` 0 squashes the whole image to side x side. Otherwise the image keeps its aspect:
    its shorter side is resized to `resize` and the centre side x side is cut out, as
    torchvision's `Resize(resize)` + `CenterCrop(side)` (the ImageNet habit: 256 then 224).
    """

    side: int
    resize: int = 0

    def __post_init__(self):
        if self.resize and self.resize < self.side:
            raise ValueError(f"a {self.side}-pixel centre crop needs the shorter side resized to "
                             f"at least {self.side}, not {self.resize}")

    @property
    def name(self) -> str:
        return f"{self.side}px" if not self.resize else f"{self.side}px-of-{self.resize}"

    @classmethod
    def parse(cls, name: str) -> Geometry:
        side, _, resize = name.removesuffix("px").partition("px-of-")
        return cls(int(side), int(resize or 0))

    @property
    def draft(self) -> tuple[int, int]:
        """The smallest size a JPEG may be decoded at (PIL's draft keeps both sides above)."""
        return (self.resize, self.resize) if self.resize else (self.side, self.side)

    def apply(self, img: Image.Image) -> Image.Image:
        if not self.resize:
            return img.resize((self.side, self.side), Image.BILINEAR)
        width, height = img.size
        # torchvision's Resize(int): the shorter side becomes `resize`, the longer one keeps
        # the aspect (truncated), then CenterCrop's rounding of the offsets.
        if width <= height:
            size = (self.resize, int(self.resize * height / width))
        else:
            size = (int(self.resize * width / height), self.resize)
        img = img.resize(size, Image.BILINEAR)
        left = int(round((size[0] - self.side) / 2.0))
        top = int(round((size[1] - self.side) / 2.0))
        return img.crop((left, top, left + self.side, top + self.side))


def as_geometry(side: int | Geometry) -> Geometry:
    return side if isinstance(side, Geometry) else Geometry(side)


def load_resized(path: Path | BinaryIO, side: int | Geometry, channels: int) -> np.ndarray:
    """uint8 [C, side, side]: the one decode and resize used for training, evaluation and
    serving (the registered model calls it on the bytes it is sent); `side` a Geometry for an
    aspect-preserving centre crop."""
    geometry = as_geometry(side)
    img = geometry.apply(open_image(path, channels, draft=geometry.draft))
    arr = np.asarray(img, dtype=np.uint8)
    return arr[None] if channels == 1 else arr.transpose(2, 0, 1)


def load_resized_bytes(value: bytes | str, side: int | Geometry, channels: int) -> np.ndarray:
    """`load_resized` for what a client sends: encoded bytes, or base64 text of them."""
    if isinstance(value, str):
        try:
            value = base64.b64decode(value, validate=False)
        except (binascii.Error, ValueError) as e:
            raise ImageRejected(f"not base64 image data: {e}") from None
    if not isinstance(value, bytes | bytearray) or not value:
        raise ImageRejected("no image bytes in this row")
    return load_resized(io.BytesIO(value), side, channels)
