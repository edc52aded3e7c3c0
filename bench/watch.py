"""What watch-data costs on a large unchanged folder, against one decode pass of it.

    python -m bench.watch --images 25000 --repeats 3

The folder: the real flowers-128 photos (../shared/data/flowers-128), hard-linked over and
over into five class folders until it holds IMAGES files (distinct paths, the same bytes: a
stat costs the same, a decode too). Alternated per repeat: the watch's work for one deployment
(list the labelled files, stat each, compare with the baseline, digest the listing), then one
decode pass (PIL open, RGB, resize to 64 px: the least the split stage's decode does). Wall
and CPU seconds, medians.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from PIL import Image

from training.config import DatasetSpec
from training.data.watch import compare, listing

PHOTOS = Path(__file__).resolve().parents[2] / "shared" / "data" / "flowers-128"


def grow(folder: Path, images: int) -> int:
    sources = sorted(p for p in PHOTOS.rglob("*.jpg"))
    for i in range(images):
        source = sources[i % len(sources)]
        target = folder / source.parent.name / f"{i // len(sources)}-{source.name}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(source, target)
    return images


def timed(work) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def watch(spec: DatasetSpec, baseline: dict) -> None:
    now = listing(spec)
    changes = compare(baseline, now)
    hashlib.sha256(json.dumps(now, sort_keys=True).encode()).hexdigest()
    assert not changes.any


def decode(spec: DatasetSpec, baseline: dict) -> None:
    root = Path(spec.source)
    for path in baseline:
        with Image.open(root / path) as image:
            image.draft("RGB", (64, 64))
            image.convert("RGB").resize((64, 64))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=25_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "photos"
        grow(folder, args.images)
        spec = DatasetSpec(source=str(folder))
        baseline = listing(spec)
        results = {"watch": [], "decode": []}
        for _ in range(args.repeats):
            results["watch"].append(timed(lambda: watch(spec, baseline)))
            results["decode"].append(timed(lambda: decode(spec, baseline)))
    print(f"{args.images} unchanged images, {args.repeats} repeats, medians:")
    print("| work | wall s | CPU s |\n|---|---|---|")
    medians = {}
    for name, runs in results.items():
        medians[name] = (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
        print(f"| {name} | {medians[name][0]:.2f} | {medians[name][1]:.2f} |")
    print(f"watch / decode, wall: {medians['watch'][0] / medians['decode'][0]:.3f}")


if __name__ == "__main__":
    main()
