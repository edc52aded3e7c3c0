"""The three pictures logged with every run (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from training.data.rows import open_any
from training.engine.events import EpochMetrics

if TYPE_CHECKING:
    import torch


def pyplot():
    """matplotlib on its file-only backend, imported when a picture is drawn: importing the
    flow (which draws the curves) must not pay for it, nor for torch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def training_curves_png(history: list[EpochMetrics], path: Path) -> Path:
    plt = pyplot()
    epochs = [h.epoch for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in ((ax_loss, "loss"), (ax_acc, "accuracy")):
        ax.plot(epochs, [getattr(h, f"train_{metric}") for h in history], "o-", label=f"train {metric}")
        ax.plot(epochs, [getattr(h, f"val_{metric}") for h in history], "o-", label=f"val {metric}")
        ax.set_xlabel("epoch")
        ax.set_title(metric)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def confusion_matrix_png(matrix: list[list[int]], class_names: list[str], path: Path) -> Path:
    plt = pyplot()
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
    """The misclassified test images the model was most confident about, four to a row."""
    import torch

    plt = pyplot()
    probs = torch.softmax(logits, 1)
    confidence, predicted = probs.max(1)
    wrong = (predicted != labels).nonzero().flatten().tolist()
    wrong = sorted(wrong, key=lambda i: -float(confidence[i]))[:count]
    cols, side, caption = 4, 120, 28
    rows = max(1, -(-len(wrong) // cols))
    # One mosaic on one axes: a grid of sixteen titled axes costs most of the drawing time.
    mosaic = Image.new("RGB", (cols * side, rows * (side + caption)), "white")
    for n, i in enumerate(wrong):
        image = open_any(root / paths[i], channels=3)
        # Small images (digits are 8x8) are enlarged as blocks, not blurred.
        thumb = image.resize((side - 8, side - 8), Image.NEAREST if image.width < side else None)
        mosaic.paste(thumb, ((n % cols) * side + 4, (n // cols) * (side + caption) + caption))
    fig = plt.figure(figsize=(mosaic.width / 50, mosaic.height / 50))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.imshow(mosaic)
    ax.axis("off")
    for n, i in enumerate(wrong):
        ax.text((n % cols + 0.5) * side, (n // cols) * (side + caption) + caption - 4,
                f"true {class_names[labels[i]]}\npred {class_names[predicted[i]]} "
                f"({float(confidence[i]):.2f})", ha="center", va="bottom", fontsize=8)
    if not wrong:
        ax.text(mosaic.width / 2, mosaic.height / 2, "no misclassified test images",
                ha="center")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
