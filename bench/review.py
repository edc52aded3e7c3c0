"""The review report's cost beside the gate (the target: under 10 s for 10 classes and
10,000 test images).

    .venv/bin/python -m bench.review [--images 10000] [--classes 10] [--repeats 5]

Two models' answers on generated test images (the gallery's thumbnails read real PNG files),
then training/evaluation/review.py's figures (1,000 bootstrap resamples) and page. Prints the
median of each part over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from training.evaluation.review import ModelAnswers, compare, write_review


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from tests.imagegen import photo

    rng = np.random.default_rng(0)
    n, k = args.images, args.classes
    names = [f"class{c}" for c in range(k)]
    truth = rng.integers(0, k, n)
    models = [ModelAnswers(name, np.where(rng.random(n) < right, truth, rng.integers(0, k, n)),
                     rng.uniform(0.3, 1.0, n)) for name, right in
              (("challenger v2", 0.92), ("champion v1", 0.90))]
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        paths = [f"{names[truth[i]]}/{i}.png" for i in range(n)]
        for path in paths:  # every image a file, as in a split
            (root / path).parent.mkdir(exist_ok=True)
            photo(path.split("/")[0], int(Path(path).stem), 64).save(root / path)
        timings: dict[str, list[float]] = {"figures": [], "page": []}
        for _ in range(args.repeats):
            start = time.perf_counter()
            figures = compare(truth, models, names)
            timings["figures"].append(time.perf_counter() - start)
            start = time.perf_counter()
            write_review(root / "review", "v2: bench", figures, paths, root, truth, models)
            timings["page"].append(time.perf_counter() - start)
    medians = {part: statistics.median(t) for part, t in timings.items()}
    print(f"{n} images, {k} classes, {args.repeats} repeats (medians): figures "
          f"{medians['figures']:.2f} s, page {medians['page']:.2f} s, total "
          f"{sum(medians.values()):.2f} s")


if __name__ == "__main__":
    main()
