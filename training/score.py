"""Score image files with a logged MLflow model, each image exactly once across the ranks.

    python -m training.score --model MODEL_DIR --images LIST.txt --out DIR
    accelerate launch --multi_gpu --num_processes 2 -m training.score --model MODEL_DIR \
        --images LIST.txt --out DIR

MODEL_DIR is a downloaded MLflow model (`mlflow artifacts download -u models:/NAME@champion`);
LIST.txt holds one image path per line. The ranks share the list out without padding
(`split_between_processes`), each runs the model's own pyfunc `predict` on its share, and the
main process writes DIR/predictions.csv in the list's order: path, label, probability, one
`probability_<class>` column per class, error (why an image could not be scored).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from accelerate import Accelerator

from training.data.rows import image_bytes
from training.engine.events import Heartbeat, ScoringFinished
from training.engine.progress import ProgressWriter, Rank
from training.engine.ranks import run_ranks
from training.evaluation.drift import STATISTICS, image_statistics
from training.processes import exit_after_teardown
from training.storage import write_text_atomic

CHUNK = 256
STATISTIC_PREFIX = "statistic_"


def score(model_dir: Path, paths: list[str], accelerator: Accelerator, rank: Rank,
          progress: ProgressWriter, statistics: int = 0):
    """The predictions of every path, in order, on the main process (None elsewhere);
    `statistics`: with STATISTICS columns (`statistic_<name>`) for predict-flow's drift check,
    read from about that many images spread evenly over the list (NaN for the others)."""
    import mlflow
    import pandas as pd
    import torch

    if accelerator.device.type == "cuda":  # each rank scores on its own GPU
        torch.cuda.set_device(accelerator.device)
    if rank.main:
        threads = torch.get_num_threads()
        print(f"scoring {len(paths)} images: {rank.world} process{'es' * (rank.world > 1)}, "
              f"{threads} thread{'s' * (threads > 1)} each", flush=True)
        for line in other_versions(model_dir):
            print(f"warning: the model was logged with {line}", flush=True)
    # MLflow's own check of the same pins maps every installed distribution first: about 2 s
    # of every scoring process on 2 cores, for what other_versions says in a few lookups.
    model = mlflow.pyfunc.load_model(str(model_dir), suppress_warnings=True)
    frames = []
    with accelerator.split_between_processes(list(range(len(paths)))) as mine:
        for start in range(0, len(mine), CHUNK):
            rows = mine[start:start + CHUNK]
            images = [_read(paths[i]) for i in rows]
            frame = model.predict(pd.DataFrame({"image": images}))
            frame.insert(0, "path", [paths[i] for i in rows])
            if statistics:
                every = -(-len(paths) // statistics)  # a sample is enough for the tests
                values = np.array([image_statistics(data) if i % every == 0 else
                                   (np.nan,) * len(STATISTICS)
                                   for i, data in zip(rows, images, strict=True)]).reshape(
                    len(images), len(STATISTICS))
                for k, name in enumerate(STATISTICS):
                    frame[f"{STATISTIC_PREFIX}{name}"] = values[:, k]
            frame.index = rows
            frames.append(frame)
            progress.emit(Heartbeat, phase="score", step=start + len(rows), total=len(mine))
    from accelerate.utils import gather_object

    # Frames are pickled between this job's own ranks only, never read from a store.
    everything = gather_object(frames)
    if not rank.main:
        return None
    return pd.concat(everything).sort_index() if everything else None


def other_versions(model_dir: Path) -> list[str]:
    """The model's pinned requirements (and Python) that this environment does not have, as
    "name==logged (installed: version)"; empty when it matches, as a served model should."""
    import importlib.metadata
    import platform

    import yaml

    found = []
    # train-flow logs every requirement as name==version (tasks/register.py); other lines are
    # not ours to judge.
    requirements = model_dir / "requirements.txt"  # absent from a model logged without pins
    for line in requirements.read_text().splitlines() if requirements.is_file() else []:
        name, pinned, version = line.strip().partition("==")
        if not pinned or not name or " " in name:
            continue
        try:
            installed = importlib.metadata.version(name.split("[")[0])
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{line.strip()} (not installed)")
            continue
        if installed.split("+")[0] != version.split("+")[0]:  # a local tag (+cpu) is a build
            found.append(f"{line.strip()} (installed: {installed})")
    flavors = yaml.safe_load((model_dir / "MLmodel").read_text()).get("flavors") or {}
    logged = str((flavors.get("python_function") or {}).get("python_version", ""))
    if logged and logged.split(".")[:2] != platform.python_version().split(".")[:2]:
        found.append(f"Python {logged} (running: {platform.python_version()})")
    return found


def _read(path: str) -> bytes:
    try:
        return image_bytes(path)
    except OSError:
        return b""  # the model reports the row as unreadable; the others are still scored


def write_predictions(predictions, out: Path) -> None:
    """predictions.csv, and the sampled images' drift statistics apart in statistics.csv."""
    measured = [c for c in predictions.columns if c.startswith(STATISTIC_PREFIX)]
    if measured:
        statistics = predictions[["path", *measured]].dropna()
        write_text_atomic(out / "statistics.csv", statistics.rename(
            columns=lambda c: c.removeprefix(STATISTIC_PREFIX)).to_csv(index=False))
    write_text_atomic(out / "predictions.csv",
                      predictions.drop(columns=measured).to_csv(index=False))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Score image files with a logged model.")
    parser.add_argument("--model", type=Path, required=True, help="a downloaded MLflow model")
    parser.add_argument("--images", type=Path, required=True, help="a file of image paths")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--statistics", type=int, default=0, metavar="N",
                        help="also write statistics.csv: the drift statistics of N images "
                        "spread over the list")
    args = parser.parse_args(argv)
    paths = args.images.read_text().splitlines()
    with run_ranks(args.out) as (accelerator, rank, progress):
        predictions = score(args.model, paths, accelerator, rank, progress, args.statistics)
        summary = None
        if predictions is not None:
            write_predictions(predictions, args.out)
            summary = {"images": len(predictions),
                       "errors": int(predictions["error"].notna().sum()),
                       "predictions": str(args.out / "predictions.csv")}
        accelerator.wait_for_everyone()
        progress.emit(ScoringFinished, world_size=rank.world, scored=summary)


if __name__ == "__main__":
    main()
    exit_after_teardown()
