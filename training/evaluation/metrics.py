"""Test-split metrics (scikit-learn) and the per-image predictions file."""

from __future__ import annotations

import csv
import io

import torch


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
        "balanced_accuracy": balanced_recall(recall, support),
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


def balanced_recall(recall, support) -> float:
    """The mean recall over the classes that have images (scikit-learn's
    balanced_accuracy_score, without its warning for a class never predicted)."""
    present = [r for r, s in zip(recall, support, strict=True) if s > 0]
    return float(sum(present) / len(present)) if present else 0.0


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
