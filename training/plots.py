"""The three pictures logged with every run (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from training.images import open_image  # noqa: E402


def training_curves_png(history: list[dict], path: Path) -> Path:
    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in ((ax_loss, "loss"), (ax_acc, "accuracy")):
        ax.plot(epochs, [h[f"train_{metric}"] for h in history], "o-", label=f"train {metric}")
        ax.plot(epochs, [h[f"val_{metric}"] for h in history], "o-", label=f"val {metric}")
        ax.set_xlabel("epoch")
        ax.set_title(metric)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def confusion_matrix_png(matrix: list[list[int]], class_names: list[str], path: Path) -> Path:
    size = max(4, 0.5 * len(class_names) + 2)
    fig, ax = plt.subplots(figsize=(size, size))
    ax.imshow(matrix, cmap="Blues")
    ticks = range(len(class_names))
    ax.set_xticks(ticks, class_names, rotation=45)
    ax.set_yticks(ticks, class_names)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    for i, row in enumerate(matrix):
        for j, count in enumerate(row):
            ax.text(j, i, str(count), ha="center", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def worst_predictions_png(root: Path, paths: list[str], labels: torch.Tensor,
                          logits: torch.Tensor, class_names: list[str], path: Path,
                          count: int = 16) -> Path:
    """The misclassified test images the model was most confident about."""
    probs = torch.softmax(logits, 1)
    confidence, predicted = probs.max(1)
    wrong = (predicted != labels).nonzero().flatten().tolist()
    wrong = sorted(wrong, key=lambda i: -float(confidence[i]))[:count]
    cols = 4
    rows = max(1, -(-len(wrong) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(2.5 * cols, 2.7 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, i in zip(axes.flat, wrong, strict=False):
        ax.imshow(open_image(root / paths[i], channels=3))
        ax.set_title(f"true {class_names[labels[i]]}\npred {class_names[predicted[i]]} "
                     f"({float(confidence[i]):.2f})", fontsize=8)
    if not wrong:
        axes[0][0].text(0.5, 0.5, "no misclassified test images", ha="center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
