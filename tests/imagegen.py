"""Small real image files for tests: class-dependent shapes and colours, any format."""

from __future__ import annotations

import io
import random
import zipfile
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"cat": (200, 80, 40), "dog": (40, 90, 200), "bird": (60, 180, 60)}


def photo(label: str, index: int, size: int = 24) -> Image.Image:
    rng = random.Random(f"{label}-{index}")
    base = COLOURS.get(label, (rng.randrange(256), rng.randrange(256), rng.randrange(256)))
    img = Image.new("RGB", (size, size), tuple(max(0, c - 60) for c in base))
    draw = ImageDraw.Draw(img)
    x, y = rng.randrange(size // 2), rng.randrange(size // 2)
    shape = draw.ellipse if label in ("cat", "bird") else draw.rectangle
    shape([x, y, x + size // 2, y + size // 2], fill=base)
    return img


def write_filename_layout(folder: Path, counts: dict[str, int], size: int = 24,
                          fmt: str = "JPEG", start: int = 0) -> list[Path]:
    """dogs-vs-cats style: cat.0.jpg, dog.0.jpg ... in one folder."""
    folder.mkdir(parents=True, exist_ok=True)
    ext = "jpg" if fmt == "JPEG" else fmt.lower()
    paths = []
    for label, n in counts.items():
        for i in range(start, start + n):
            path = folder / f"{label}.{i}.{ext}"
            photo(label, i, size).save(path, fmt)
            paths.append(path)
    return paths


def write_folder_layout(folder: Path, counts: dict[str, int], size: int = 24) -> None:
    for label, n in counts.items():
        (folder / label).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            photo(label, i, size).save(folder / label / f"img{i:03d}.png")


def dogs_vs_cats_zip(counts: dict[str, int], size: int = 24) -> bytes:
    """Laid out like the competition download: train.zip (and test1.zip) inside the archive."""
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        for label, n in counts.items():
            for i in range(n):
                buf = io.BytesIO()
                photo(label, i, size).save(buf, "JPEG")
                zf.writestr(f"train/{label}.{i}.jpg", buf.getvalue())
    outer = io.BytesIO()
    with zipfile.ZipFile(outer, "w") as zf:
        zf.writestr("train.zip", inner.getvalue())
        zf.writestr("sampleSubmission.csv", "id,label\n1,0\n")
    return outer.getvalue()
