"""Classify image files with a registered model (the champion by default).

    trainflow predict path/to/cat.1.jpg path/to/dog.7.jpg
    trainflow predict --model flowers --alias challenger img.png

Prints one line per file: path, predicted label, probability (or the reason a file could not
be read). The model decodes, resizes and normalises the files itself, as in training; for a
whole folder, under every GPU, use predict-flow.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlflow
import pandas as pd

from training.storage import tracking_uri


def predict(paths: list[Path], model_name: str, alias: str = "champion") -> pd.DataFrame:
    mlflow.set_tracking_uri(tracking_uri())
    model = mlflow.pyfunc.load_model(f"models:/{model_name}@{alias}")
    return model.predict(pd.DataFrame({"image": [p.read_bytes() for p in paths]}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trainflow predict",
                                     description="Classify image files with a registered model.")
    parser.add_argument("images", nargs="+", type=Path)
    parser.add_argument("--model", default="digits", help="registered model name: the "
                        "dataset's (a folder's name, a competition's slug) unless the run "
                        "named one; default: digits, the demo's")
    parser.add_argument("--alias", default="champion")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.images if not p.is_file()]
    if missing:
        parser.error(f"no such image file: {', '.join(missing)}")
    frame = predict(args.images, args.model, args.alias)
    for path, row in zip(args.images, frame.itertuples(), strict=True):
        # pandas 3 reads a missing error as NaN, not None.
        print(f"{path}\t{row.label}\t{row.probability:.4f}" if pd.isna(row.error)
              else f"{path}\terror\t{row.error}")


if __name__ == "__main__":
    main()
