"""What predict-flow's drift check adds per 1,000 scored images.

    python -m bench.drift --images 1000 --repeats 5

Per image, a scoring rank reads the file and runs the served model; with the drift check it
also computes the image statistics (training/evaluation/drift.py) from the same bytes. Timed
here on one process, alternated: reading the bytes (what scoring does anyway), the statistics,
and the comparison of the batch with a reference of the same size (scipy's tests). Two sets of
files: the real flowers-128 photos (about 240 x 180 JPEGs) and generated 256-500 px JPEGs
(bench/make_photos.py). Medians, in seconds per 1,000 images.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.make_photos import make as make_photos
from training.config import DriftSpec
from training.evaluation.drift import Sample, compare, image_statistics

PHOTOS = Path(__file__).resolve().parents[2] / "shared" / "data" / "flowers-128"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sets = {"flowers-128": sorted(PHOTOS.rglob("*.jpg"))[:args.images],
                "generated 256-500 px": sorted(make_photos(Path(tmp), args.images // 2 + 1)
                                               .glob("*.jpg"))[:args.images]}
        print(f"seconds per 1,000 images, medians of {args.repeats}:")
        print("| files | read bytes | statistics | compare | statistics + compare |")
        print("|---|---|---|---|---|")
        for name, paths in sets.items():
            scale = 1000 / len(paths)
            runs = {"read": [], "statistics": [], "compare": []}
            for _ in range(args.repeats):
                started = time.perf_counter()
                data = [p.read_bytes() for p in paths]
                runs["read"].append(time.perf_counter() - started)
                started = time.perf_counter()
                measured = [image_statistics(d) for d in data]
                runs["statistics"].append(time.perf_counter() - started)
                sample = Sample.of(["a", "b"] * (len(paths) // 2) + ["a"] * (len(paths) % 2),
                                   [0.9] * len(paths), measured)
                started = time.perf_counter()
                compare(sample, sample, DriftSpec())
                runs["compare"].append(time.perf_counter() - started)
            m = {k: statistics.median(v) * scale for k, v in runs.items()}
            print(f"| {name} | {m['read']:.3f} | {m['statistics']:.3f} | {m['compare']:.3f} | "
                  f"{m['statistics'] + m['compare']:.3f} |")


if __name__ == "__main__":
    main()
