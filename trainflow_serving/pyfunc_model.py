"""The registered model: encoded images in, class names and probabilities out.

Logged with MLflow's "models from code" (this file is the model; nothing of ours is
pickled), the weights as a safetensors artifact and the model's description as JSON, and the
`trainflow_serving` package as its only code, so that the served model decodes, resizes and
normalises with the very functions training used. Loading needs MLflow, torch, torchvision,
safetensors, Pillow and pandas, not this project:

    model = mlflow.pyfunc.load_model("models:/dogs-vs-cats@champion")
    model.predict(pd.DataFrame({"image": [open("cat.1.jpg", "rb").read()]}))
    #    label  probability  probability_cat  probability_dog  error
    # 0    cat        0.97             0.97             0.03   None

Input: a DataFrame with a column `image` of encoded image bytes (JPEG, PNG, ...), or base64
strings of them (what JSON clients send). Output: `label`, `probability` (of that label), one
`probability_<class>` column per class, and `error` (None, or why that row's image could not
be read; its other columns are then empty and the other rows are still predicted).
"""

from __future__ import annotations

import json
import os

import mlflow
import numpy as np
import pandas as pd
import torch

# The package travels with the model as code: MLflow puts it on the path before running this file.
from trainflow_serving import DESCRIPTION_ARTIFACT, WEIGHTS_ARTIFACT
from trainflow_serving.images import Geometry, load_resized_bytes
from trainflow_serving.networks import Normalize, build_network

BATCH = 64


def serving_device() -> torch.device:
    """The GPU this process is on when there is one (a scoring rank sets its own first), else
    the CPU; TRAINFLOW_SERVE_DEVICE (e.g. "cpu") overrides. The model loads unchanged on a
    CPU-only host."""
    if wanted := os.environ.get("TRAINFLOW_SERVE_DEVICE"):
        return torch.device(wanted)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ImageClassifier(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        from safetensors.torch import load_model

        with open(context.artifacts[DESCRIPTION_ARTIFACT]) as f:
            self.description = json.load(f)
        d = self.description
        pre = d["preprocessing"]
        self.side, self.channels = pre["image_size"], pre["channels"]
        # Evaluation's geometry exactly: squashed, or (crop_from) aspect kept and centre-cropped.
        self.geometry = Geometry(self.side, pre.get("crop_from", 0))
        self.class_names = d["class_names"]
        self.model = build_network(d["model"], len(self.class_names), self.channels, self.side)
        load_model(self.model, context.artifacts[WEIGHTS_ARTIFACT], strict=True)
        self.device = serving_device()
        self.model.to(self.device).eval()
        self.normalize = Normalize(pre["mean"], pre["std"]).to(self.device)

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None
                ) -> pd.DataFrame:
        if "image" not in model_input:
            raise ValueError('the input needs a column "image" of encoded image bytes or base64')
        images, errors = [], []
        for value in model_input["image"]:
            try:
                images.append(load_resized_bytes(value, self.geometry, self.channels))
                errors.append(None)
            except Exception as e:  # one bad row must not cost the others their predictions
                images.append(None)
                errors.append(f"{type(e).__name__}: {e}")
        good = [i for i, image in enumerate(images) if image is not None]
        probs = np.full((len(images), len(self.class_names)), np.nan)
        with torch.no_grad():
            for start in range(0, len(good), BATCH):
                rows = good[start:start + BATCH]
                batch = torch.from_numpy(np.stack([images[i] for i in rows])).to(self.device)
                logits = self.model(self.normalize(batch))
                probs[rows] = torch.softmax(logits.float(), 1).cpu().numpy()
        return predictions_frame(probs, self.class_names, errors)


def predictions_frame(probs: np.ndarray, class_names: list[str], errors: list[str | None]
                      ) -> pd.DataFrame:
    ok = ~np.isnan(probs).any(axis=1)
    best = np.where(ok, np.nan_to_num(probs).argmax(axis=1), 0)
    frame = pd.DataFrame({
        "label": [class_names[b] if good else None for b, good in zip(best, ok, strict=True)],
        "probability": np.where(ok, probs[np.arange(len(probs)), best], np.nan),
    })
    for k, name in enumerate(class_names):
        frame[f"probability_{name}"] = probs[:, k]
    frame["error"] = errors
    return frame


mlflow.models.set_model(ImageClassifier())
