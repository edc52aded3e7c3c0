"""Classify image files with a registered model (the champion by default).

    trainflow predict path/to/cat.1.jpg path/to/dog.7.jpg
    trainflow predict --model train-flow-model --alias challenger img.png

Prints one line per file: path, predicted label, probability. The preprocessing saved with
the model (image size, channels, mean, std) is applied, as in training.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlflow
import numpy as np
import torch

from training.data.images import load_resized
from training.storage import tracking_uri


def preprocess(paths: list[Path], preprocessing: dict) -> torch.Tensor:
    side, channels = preprocessing["image_size"], preprocessing["channels"]
    batch = torch.from_numpy(np.stack([load_resized(p, side, channels) for p in paths])).float()
    mean = torch.tensor(preprocessing["mean"]).view(1, -1, 1, 1) * 255
    std = torch.tensor(preprocessing["std"]).view(1, -1, 1, 1) * 255
    return (batch - mean) / std


def predict(paths: list[Path], model_name: str, alias: str = "champion"
            ) -> list[tuple[Path, str, float]]:
    mlflow.set_tracking_uri(tracking_uri())
    uri = f"models:/{model_name}@{alias}"
    metadata = mlflow.models.get_model_info(uri).metadata
    model = mlflow.pytorch.load_model(uri, map_location="cpu").eval()
    with torch.no_grad():
        probs = model(preprocess(paths, metadata["preprocessing"]))
    names = metadata["class_names"]
    return [(p, names[int(row.argmax())], float(row.max())) for p, row in zip(paths, probs, strict=True)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trainflow predict",
                                     description="Classify image files with a registered model.")
    parser.add_argument("images", nargs="+", type=Path)
    parser.add_argument("--model", default="train-flow-model", help="registered model name")
    parser.add_argument("--alias", default="champion")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.images if not p.is_file()]
    if missing:
        parser.error(f"no such image file: {', '.join(missing)}")
    for path, label, probability in predict(args.images, args.model, args.alias):
        print(f"{path}\t{label}\t{probability:.4f}")


if __name__ == "__main__":
    main()
