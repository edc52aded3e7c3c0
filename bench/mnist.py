"""MNIST as torchvision reads it: 60,000 + 10,000 digits in the official IDX format, through
`dataset.source: torchvision:MNIST`, against the seed tutorial's script (bench/mnist_tutorial.py:
torchvision's MNIST class, BasicNet, AdamW 1e-3, 1 epoch, 2 processes).

    .venv/bin/python -m bench.mnist --pairs 3

The digits are scikit-learn's 1,797, each drawn many times at a random size, place and
contrast into 28x28 (the test digits from writers the training never sees). Measures, runs
alternated in one invocation:
- data ready: torchvision's class loading train and test, against our prepare + split (the
  IDX files read into the tables and all 70,000 rows decoded into the store), on a fresh home
  and again on unchanged data;
- the whole flow (`trainflow train`, the local server reused) against the script's wall, with
  both test accuracies on the 10,000 test digits and the epoch time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.first_run import fixed_cost
from tests.formats import MNIST_FILES, write_idx

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
LOAD = """
import sys, time
started = time.perf_counter()
from torchvision import datasets
train = datasets.MNIST(sys.argv[1], train=True)
test = datasets.MNIST(sys.argv[1], train=False)
train[0], test[0]
print(time.perf_counter() - started)
"""
PREPARE = """
import sys, time
from pathlib import Path
started = time.perf_counter()
from training.config import DatasetSpec, SplitSpec, TrainingSpec
from training.data.sides import split_sides
from training.data.sources import prepare
from training.data.split import split_dataset
ref = prepare(DatasetSpec(source="torchvision:MNIST", root=sys.argv[1]), Path(sys.argv[2]))
split_dataset(ref, SplitSpec(), Path(sys.argv[2]), split_sides(TrainingSpec(image_size=28)))
print(time.perf_counter() - started)
"""


def write_digits_mnist(root: Path, train: int = 60_000, test: int = 10_000) -> None:
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = (digits.images * (255 / 16)).astype(np.uint8)
    writers = 1500  # the first 1,500 digits draw the training set, the rest the test set
    rng = np.random.default_rng(0)
    for split, count, pool in (("train", train, range(writers)),
                               ("test", test, range(writers, len(pixels)))):
        picks = rng.choice(np.array(pool), count)
        images = np.zeros((count, 28, 28), np.uint8)
        for i, k in enumerate(picks):
            side = int(rng.integers(16, 23))
            glyph = np.asarray(Image.fromarray(pixels[k]).resize((side, side), Image.BILINEAR))
            y, x = rng.integers(0, 29 - side, 2)
            images[i, y:y + side, x:x + side] = (glyph * rng.uniform(0.7, 1.0)).astype(np.uint8)
        image_file, label_file = MNIST_FILES[split]
        write_idx(root / "MNIST" / "raw" / image_file, images, 0x0803)
        write_idx(root / "MNIST" / "raw" / label_file, digits.target[picks], 0x0801)


def run(command: list[str], env: dict) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    return time.perf_counter() - started, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--data-only", action="store_true",
                        help="measure data ready only, not the flow against the script")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-mnist-"))
    data = folder / "torchvision"
    write_digits_mnist(data)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env = {**base, "TRAINFLOW_HOME": str(folder / "home"), "PREFECT_HOME": str(folder / "p")}
    script_env = {**env, "ACCELERATE_USE_CPU": "1"}
    flow = [str(BIN / "trainflow"), "train", "--dataset.source", "torchvision:MNIST",
            "--dataset.root", str(data), "--training.model", "basicnet",
            "--training.image_size", "28", "--training.epochs", "1", "--training.batch_size",
            "64", "--training.optimizer", "adamw", "--training.lr", "1e-3",
            "--training.lr_schedule", "constant", "--training.num_processes", "2", "--force",
            "--json"]
    script = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
              "-m", "bench.mnist_tutorial", "--root", str(data)]
    ready: dict[str, list[float]] = {"torchvision's class": [], "ours, fresh home": [],
                                     "ours, unchanged data": []}
    walls: dict[str, list[float]] = {"script": [], "flow": []}
    scores: dict[str, list[dict]] = {"script": [], "flow": []}
    try:
        for i in range(args.pairs):
            ready["torchvision's class"].append(float(run([sys.executable, "-c", LOAD,
                                                           str(data)], env)[1]))
            fresh = str(folder / f"fresh{i}")
            ready["ours, fresh home"].append(float(run([sys.executable, "-c", PREPARE,
                                                        str(data), fresh], env)[1]))
            ready["ours, unchanged data"].append(float(run([sys.executable, "-c", PREPARE,
                                                            str(data), fresh], env)[1]))
            shutil.rmtree(fresh)
        if not args.data_only:
            run(flow, env)  # the flow's home: tables, store and the local server, once
        for _ in range(0 if args.data_only else args.pairs):
            seconds, out = run(script, script_env)
            walls["script"].append(seconds)
            scores["script"].append(json.loads(out.strip().splitlines()[-1]))
            seconds, out = run(flow, env)
            walls["flow"].append(seconds)
            result = json.loads(out)
            trained = result["trained"]
            scores["flow"].append({
                "test_accuracy": result["evaluation"]["metrics"]["accuracy"],
                "epoch_seconds": trained["history"][0]["epoch_seconds"],
                "world_size": trained["world_size"], **fixed_cost(result, env)})
    finally:
        subprocess.run([str(BIN / "trainflow"), "services", "stop"], env=env,
                       capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)
    print(f"| data ready (60,000 + 10,000 digits, {args.pairs} runs) | median s | runs | "
          "vs torchvision |\n|---|---|---|---|")
    reference = statistics.median(ready["torchvision's class"])
    for name, values in ready.items():
        print(f"| {name} | {statistics.median(values):.2f} | "
              f"{', '.join(f'{v:.2f}' for v in values)} | "
              f"{statistics.median(values) / reference:.2f}x |")
    if args.data_only:
        return
    print("\n| 1 epoch, 2 processes | wall s (median) | runs | epoch s | test accuracy "
          "(10,000) |\n|---|---|---|---|---|")
    for name in ("script", "flow"):
        epoch = statistics.median(s["epoch_seconds"] for s in scores[name])
        accuracy = statistics.median(s["test_accuracy"] for s in scores[name])
        print(f"| {name} | {statistics.median(walls[name]):.1f} | "
              f"{', '.join(f'{v:.1f}' for v in walls[name])} | {epoch:.1f} | {accuracy:.4f} |")
    print(f"\nflow / script: {statistics.median(walls['flow']) / statistics.median(walls['script']):.2f}x;"
          f" flow stages (median s): " + ", ".join(
              f"{stage} {statistics.median(s['stages'].get(stage, 0) for s in scores['flow']):.1f}"
              for stage in scores["flow"][0]["stages"]))


if __name__ == "__main__":
    main()
