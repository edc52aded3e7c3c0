"""Evaluate the best weights on the test split: metrics, predictions and pictures.

    python -m training.evaluate --job JOB.json --out DIR
    accelerate launch --multi_gpu --num_processes 2 -m training.evaluate --job JOB.json --out DIR

Each test image is counted exactly once whatever the world size (gather_for_metrics), and the
numbers equal a single-process evaluation.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
from pathlib import Path

import torch
from safetensors.torch import load_model
from torch.utils.data import DataLoader

from training.config import TrainJob
from training.data import CachedImages, Normalize, decode_split
from training.models import build_model, input_channels, normalization
from training.split import read_summary
from training.storage import write_json_atomic, write_text_atomic


def load_trained_model(job: TrainJob, weights: Path) -> tuple[torch.nn.Module, dict]:
    """A fresh model with the saved weights, and the preprocessing it expects."""
    spec = job.training
    summary = read_summary(job.manifest)
    channels = input_channels(spec.model, summary.channels)
    model = build_model(spec.model, len(summary.class_names), channels, spec.image_size)
    load_model(model, str(weights), strict=True)
    mean, std = normalization(spec.model, spec.pretrained, channels)
    preprocessing = {"image_size": spec.image_size, "channels": channels, "mean": mean,
                     "std": std, "resize": "bilinear, squashed to a square", "scale": "1/255"}
    return model.eval(), {"class_names": summary.class_names, "preprocessing": preprocessing}


def predict_test_split(job: TrainJob, weights: Path, accelerator=None, split: str = "test"):
    """(logits [N, K], labels [N], paths, info) in manifest order over one split."""
    model, info = load_trained_model(job, weights)
    pre = info["preprocessing"]
    summary = read_summary(job.manifest)
    images, labels, paths = decode_split(summary.root, job.manifest, split, pre["image_size"],
                                         pre["channels"], job.manifest.parent / "cache")
    dataset = IndexedImages(CachedImages(images, labels, pre["image_size"], augment=False))
    loader = DataLoader(dataset, batch_size=job.training.batch_size)
    normalize = Normalize(pre["mean"], pre["std"])
    if accelerator is not None:
        model, loader = accelerator.prepare(model, loader)
        normalize = normalize.to(accelerator.device)
    outputs, indices = [], []
    with torch.no_grad():
        for batch, _, index in loader:
            logits = model(normalize(batch)).float()
            if accelerator is not None:
                logits, index = accelerator.gather_for_metrics((logits, index))
            outputs.append(logits.cpu())
            indices.append(index.cpu())
    order = torch.cat(indices).argsort()
    logits = torch.cat(outputs)[order]
    if len(logits) != len(labels):
        raise RuntimeError(f"evaluated {len(logits)} images, the {split} split has {len(labels)}")
    return logits, torch.from_numpy(labels), paths, info


class IndexedImages(torch.utils.data.Dataset):
    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        image, label = self.inner[i]
        return image, label, i


def compute_metrics(logits: torch.Tensor, labels: torch.Tensor, class_names: list[str]) -> dict:
    from sklearn.metrics import (
        accuracy_score,
        confusion_matrix,
        f1_score,
        precision_recall_fscore_support,
        roc_auc_score,
    )

    y_true = labels.numpy()
    probs = torch.softmax(logits, 1).numpy()
    y_pred = probs.argmax(1)
    k = list(range(len(class_names)))
    precision, recall, f1, support = precision_recall_fscore_support(
        y_true, y_pred, labels=k, zero_division=0)
    metrics = {
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "loss": float(torch.nn.functional.cross_entropy(logits, labels).item()),
        "macro_f1": float(f1_score(y_true, y_pred, labels=k, average="macro", zero_division=0)),
        "images": int(len(y_true)),
        "per_class": {name: {"precision": float(p), "recall": float(r), "f1": float(f),
                             "support": int(s)}
                      for name, p, r, f, s in zip(class_names, precision, recall, f1, support,
                                                  strict=True)},
        "confusion_matrix": confusion_matrix(y_true, y_pred, labels=k).tolist(),
    }
    if len(class_names) == 2:
        metrics["roc_auc"] = float(roc_auc_score(y_true, probs[:, 1]))
    return metrics


def predictions_csv(paths: list[str], labels: torch.Tensor, logits: torch.Tensor,
                    class_names: list[str]) -> str:
    probs = torch.softmax(logits, 1)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["path", "label", "predicted", "probability", "correct"])
    for path, label, p in zip(paths, labels.tolist(), probs, strict=True):
        pred = int(p.argmax())
        writer.writerow([path, class_names[label], class_names[pred], f"{float(p[pred]):.6f}",
                         int(pred == label)])
    return buffer.getvalue()


def evaluate(job: TrainJob, weights: Path, out: Path, accelerator=None) -> dict | None:
    """Write metrics.json, predictions.csv and the pictures into `out` (main process only)."""
    logits, labels, paths, info = predict_test_split(job, weights, accelerator)
    if accelerator is not None and not accelerator.is_main_process:
        return None
    names = info["class_names"]
    metrics = compute_metrics(logits, labels, names)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "metrics.json", metrics)
    write_text_atomic(out / "predictions.csv", predictions_csv(paths, labels, logits, names))
    from training.plots import confusion_matrix_png, worst_predictions_png

    confusion_matrix_png(metrics["confusion_matrix"], names, out / "confusion_matrix.png")
    summary = read_summary(job.manifest)
    worst_predictions_png(summary.root, paths, labels, logits, names,
                          out / "worst_predictions.png")
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Evaluate best weights on the test split.")
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--weights", type=Path, help="default: best.safetensors of the job")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from accelerate import Accelerator

    from training.faults import die_with_parent
    from training.train import load_job

    die_with_parent()
    job = load_job(args.job)
    accelerator = Accelerator()
    metrics = evaluate(job, args.weights or job.output_dir / "best.safetensors", args.out,
                       accelerator)
    # Ranks leave together and tear the process group down cleanly: a rank that exits while
    # the main one is still writing pictures can make gloo abort the survivor (SIGABRT).
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if metrics is not None:
        print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, dict | list)}))


if __name__ == "__main__":
    main()



