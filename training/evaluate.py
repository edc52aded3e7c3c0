"""Evaluate trained weights on the test split: metrics, predictions and pictures.

    python -m training.evaluate --job JOB.json --out DIR
    accelerate launch --multi_gpu --num_processes 2 -m training.evaluate --job JOB.json --out DIR

JOB.json is the training job (the one training wrote into its output folder); the weights
default to its `best.safetensors`. Each test image is counted exactly once whatever the world
size (gather_for_metrics), and the numbers equal a single-process evaluation. The main
process writes metrics.json, predictions.csv, logits.safetensors and the pictures into DIR
and reports the scalar metrics in its `Evaluated` progress event.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, Dataset

from trainflow_serving.networks import Normalize
from training.data.cache import CachedImages, decode_split
from training.engine.events import Evaluated, Heartbeat, Predicted
from training.engine.progress import ProgressWriter, Rank
from training.engine.ranks import run_ranks
from training.evaluation.metrics import compute_metrics, predictions_csv
from training.handoff import TrainJob, job_for_ranks
from training.models.build import load_trained, preprocessing_for
from training.processes import exit_after_teardown
from training.storage import write_json_atomic, write_text_atomic

LOGITS = "logits.safetensors"
"""The test split's logits and labels, in manifest order (predictions.csv's rows)."""


class IndexedImages(Dataset):
    """Images with their position, so gathered predictions can be put back in manifest order."""

    def __init__(self, inner: Dataset):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        image, label = self.inner[i]
        return image, label, i


@torch.no_grad()
def predict_split(job: TrainJob, weights: Path, accelerator: Accelerator, progress: ProgressWriter,
                  split: str = "test") -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(logits [N, K], labels [N], paths) in manifest order over one split."""
    model = load_trained(job, weights)
    pre = preprocessing_for(job)
    # One rank decodes what is missing under the store's lock; the others wait on the lock,
    # not in a collective (training.train.make_loaders says why).
    # Evaluation's geometry, the served model's own (its preprocessing), whatever the split.
    images = decode_split(job.split, split, pre.geometry, pre.channels)
    labels, paths = images.labels, images.paths
    dataset = IndexedImages(CachedImages(images))
    # The model is not prepared: no DDP wrapper is needed for inference, and none of the
    # training's mixed-precision autocast, so the metrics are those of the fp32 model served.
    model = model.to(accelerator.device).eval()
    loader = accelerator.prepare(DataLoader(dataset, batch_size=job.training.batch_size))
    normalize = Normalize(pre.mean, pre.std).to(accelerator.device)
    outputs, indices = [], []
    for step, (batch, _, index) in enumerate(loader, start=1):
        logits = model(normalize(batch)).float()
        logits, index = accelerator.gather_for_metrics((logits, index))
        outputs.append(logits.cpu())
        indices.append(index.cpu())
        if step % 10 == 0:
            progress.emit(Heartbeat, phase=f"evaluate {split}", step=step, total=len(loader),
                          images=len(batch))
    logits = torch.cat(outputs)[torch.cat(indices).argsort()]
    if len(logits) != len(labels):
        raise RuntimeError(f"evaluated {len(logits)} images, the {split} split has {len(labels)}")
    return logits, torch.from_numpy(labels), paths


def evaluate(job: TrainJob, weights: Path, out: Path, accelerator: Accelerator, rank: Rank,
             progress: ProgressWriter) -> dict | None:
    """Write metrics.json, predictions.csv and the pictures into `out` (main process only)."""
    if predict_into(job, weights, out, accelerator, rank, progress) is None:  # not main
        return None
    return write_results(job, out)


def predict_into(job: TrainJob, weights: Path, out: Path, accelerator: Accelerator, rank: Rank,
                 progress: ProgressWriter) -> int | None:
    """The test split's logits (logits.safetensors) and predictions.csv in `out`, written by
    the main process, which returns how many images it holds (None elsewhere)."""
    logits, labels, paths = predict_split(job, weights, accelerator, progress)
    if not rank.main:
        return None
    out.mkdir(parents=True, exist_ok=True)
    save_file({"logits": logits.contiguous(), "labels": labels.contiguous()},
              str(out / LOGITS))
    write_text_atomic(out / "predictions.csv",
                      predictions_csv(paths, labels, logits, job.split.class_names))
    return len(labels)


def write_results(job: TrainJob, out: Path) -> dict:
    """metrics.json and the pictures, from what `predict_into` wrote. Any process may do this:
    under train-flow the task does, so that scikit-learn and matplotlib, which the task imports
    anyway, are not imported again in a rank (about 5 s on the critical path on 2 cores)."""
    saved = load_file(str(out / LOGITS))
    logits, labels = saved["logits"], saved["labels"]
    with open(out / "predictions.csv", newline="") as f:
        paths = [row["path"] for row in csv.DictReader(f)]
    names = job.split.class_names
    metrics = compute_metrics(logits, labels, names)
    write_json_atomic(out / "metrics.json", metrics)
    from training.evaluation.plots import confusion_matrix_png, worst_predictions_png

    confusion_matrix_png(metrics["confusion_matrix"], names, out / "confusion_matrix.png")
    worst_predictions_png(job.split.root, paths, labels, logits, names,
                          out / "worst_predictions.png")
    return metrics


def summarize(metrics: dict) -> dict:
    """The metrics without the confusion matrix: what the `Evaluated` message carries."""
    return {k: v for k, v in metrics.items() if not isinstance(v, list)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Evaluate trained weights on the test split.")
    parser.add_argument("--job", type=Path, required=True, help="the training job file")
    parser.add_argument("--weights", type=Path, help="default: best.safetensors of the job")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--predictions-only", action="store_true",
                        help="write logits.safetensors and predictions.csv only; the caller "
                        "makes the metrics and pictures with write_results (train-flow does)")
    args = parser.parse_args(argv)

    job = job_for_ranks(args.job)
    weights = args.weights or job.output_dir / "best.safetensors"
    with run_ranks(args.out) as (accelerator, rank, progress):
        if args.predictions_only:
            images = predict_into(job, weights, args.out, accelerator, rank, progress)
            accelerator.wait_for_everyone()
            if images is not None:
                progress.emit(Predicted, images=images, world_size=rank.world,
                              out=str(args.out))
            return
        metrics = evaluate(job, weights, args.out, accelerator, rank, progress)
        # Ranks leave together and tear the process group down cleanly: a rank that exits
        # while the main one is still writing pictures can make gloo abort the survivor.
        accelerator.wait_for_everyone()
        if metrics is not None:  # the main rank's
            summary = summarize(metrics)
            print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)}))
            progress.emit(Evaluated, metrics=summary, world_size=rank.world, out=str(args.out))


if __name__ == "__main__":
    main()
    exit_after_teardown()
