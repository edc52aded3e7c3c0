"""A photo-like JPEG dataset for benchmarks, generated (never committed).

    python -m bench.make_photos OUT_FOLDER --per-class 600

Two classes, "cat" (warm ellipses) and "dog" (cool rectangles), 256-500 px JPEGs with noise and
clutter, named like Kaggle's dogs-vs-cats (cat.12.jpg) so `labels: filename` reads them.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def photo(label: str, index: int) -> Image.Image:
    rng = random.Random(f"{label}:{index}")
    w, h = rng.randint(256, 500), rng.randint(256, 500)
    noise = np.random.default_rng(index).integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), np.uint8)
    img = Image.fromarray(noise).resize((w, h), Image.BILINEAR).filter(ImageFilter.GaussianBlur(3))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(2, 5)):  # clutter shared by both classes
        x, y = rng.randrange(w), rng.randrange(h)
        draw.line([x, y, rng.randrange(w), rng.randrange(h)], fill=(rng.randrange(256),) * 3,
                  width=rng.randint(1, 6))
    warm = label == "cat"
    colour = ((rng.randint(150, 255), rng.randint(40, 120), rng.randint(0, 60)) if warm
              else (rng.randint(0, 60), rng.randint(60, 140), rng.randint(150, 255)))
    size = rng.randint(min(w, h) // 4, min(w, h) // 2)
    x, y = rng.randrange(w - size), rng.randrange(h - size)
    (draw.ellipse if warm else draw.rectangle)([x, y, x + size, y + size], fill=colour)
    return img


def make(folder: Path, per_class: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for label in ("cat", "dog"):
        for i in range(per_class):
            path = folder / f"{label}.{i}.jpg"
            if not path.exists():
                photo(label, i).save(path, "JPEG", quality=90)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--per-class", type=int, default=600)
    args = parser.parse_args()
    make(args.folder, args.per_class)


if __name__ == "__main__":
    main()
