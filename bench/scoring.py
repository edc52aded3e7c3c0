"""Batch scoring throughput: the registered model through predict-flow's launch (1 and 2
processes) and in-process, against the previous predict command's way, on the same files.

    python -m bench.scoring --per-class 1500 --pairs 3

The previous `flows/predict.py` decoded every file with `load_resized` in one process and
ran one forward pass over a normalised batch of a pickled PyTorch model; that loop is
reproduced here on the same weights ("previous predict"). Images/s count the whole wall time
of each way, model loading and (for the launches) process start-up included.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.make_photos import make as make_photos
from runtime.launcher import launch
from tasks.train import run_training
from trainflow_serving.images import load_resized
from training.config import DatasetSpec, SplitSpec, TrainingSpec
from training.data.sources import prepare
from training.data.split import split_dataset
from training.handoff import TrainJob, TrainResult
from training.models.build import load_trained

LOG = logging.getLogger("bench")


def previous_predict(trained: TrainResult, paths: list[Path]) -> None:
    model = load_trained(trained.job, trained.weights)
    pre = trained.preprocessing
    mean = torch.tensor(pre.mean).view(1, -1, 1, 1) * 255
    std = torch.tensor(pre.std).view(1, -1, 1, 1) * 255
    with torch.no_grad():
        for start in range(0, len(paths), 64):
            batch = np.stack([load_resized(p, pre.image_size, pre.channels)
                              for p in paths[start:start + 64]])
            torch.softmax(model((torch.from_numpy(batch).float() - mean) / std), 1)


def pyfunc_in_process(model_dir: Path, paths: list[Path]) -> None:
    import mlflow
    import pandas as pd

    model = mlflow.pyfunc.load_model(str(model_dir))
    for start in range(0, len(paths), 256):
        model.predict(pd.DataFrame({"image": [p.read_bytes() for p in paths[start:start + 256]]}))


def launched(model_dir: Path, listing: Path, out: Path, processes: int) -> None:
    shutil.rmtree(out, ignore_errors=True)
    launch(TrainingSpec(num_processes=processes), "training.score",
           ["--model", str(model_dir), "--images", str(listing), "--out", str(out)], out, LOG,
           on_event=lambda event: None)


def registered_model(trained: TrainResult, home: Path) -> Path:
    """Log the model exactly as register_model does, into a throwaway store; its local folder."""
    import mlflow

    from tasks.packaging import log_model

    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    experiment = mlflow.create_experiment("bench", artifact_location=(home / "art").as_uri())
    with mlflow.start_run(experiment_id=experiment) as run:
        uri = log_model(trained, run.info.run_id).model_uri
    return Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(home / "model")))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-class", type=int, default=1500)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    logging.disable(logging.INFO)
    home = Path(tempfile.mkdtemp(prefix="trainflow-bench-scoring-"))
    os.environ["TRAINFLOW_HOME"] = str(home)
    try:
        photos = make_photos(home / "photos", args.per_class)
        split = split_dataset(prepare(DatasetSpec(source=str(photos), labels="filename"), home),
                              SplitSpec(), home)
        job = TrainJob(split=split, output_dir=home / "train",
                       training={"model": "resnet18", "image_size": 64, "epochs": 1,
                                 "batch_size": 64})
        trained = run_training(job, LOG)
        model_dir = registered_model(trained, home)
        paths = sorted(photos.glob("*.jpg"))
        listing = home / "images.txt"
        listing.write_text("".join(f"{p}\n" for p in paths))
        ways = {
            "previous predict (1 process, in-process)": lambda: previous_predict(trained, paths),
            "registered model, pyfunc in-process": lambda: pyfunc_in_process(model_dir, paths),
            "predict-flow launch, 1 process": lambda: launched(model_dir, listing,
                                                               home / "s1", 1),
            "predict-flow launch, 2 processes": lambda: launched(model_dir, listing,
                                                                 home / "s2", 2),
        }
        rates: dict[str, list[float]] = {name: [] for name in ways}
        for pair in range(args.pairs):
            order = list(ways)[pair % len(ways):] + list(ways)[:pair % len(ways)]
            for name in order:
                started = time.perf_counter()
                ways[name]()
                rates[name].append(len(paths) / (time.perf_counter() - started))
        base = statistics.median(rates["previous predict (1 process, in-process)"])
        lines = [f"{len(paths)} generated JPEGs (256-500 px), resnet18 at 64 px, "
                 f"{args.pairs} alternated rounds, {os.cpu_count()} CPUs", "",
                 "| way | images/s (median) | min-max | vs previous |", "|---|---|---|---|"]
        for name, values in rates.items():
            lines.append(f"| {name} | {statistics.median(values):.0f} | {min(values):.0f}-"
                         f"{max(values):.0f} | {statistics.median(values) / base:.2f}x |")
        print("\n".join(lines))
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
