"""evaluate_model: test-split metrics and pictures, logged to the flow's MLflow run."""

from __future__ import annotations

import time
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from prefect import task
from pydantic import BaseModel

from tasks import run_logger
from tasks.train import TrainResult
from training.config import TrainingSpec, TrainJob
from training.evaluate import evaluate
from training.plots import training_curves_png
from training.storage import tracking_uri


class Evaluation(BaseModel):
    metrics: dict[str, float]
    """accuracy, loss, macro_f1 (and roc_auc for two classes) on the test split"""
    per_class: dict[str, dict[str, float]]
    output_dir: Path
    predictions: Path


@task
def evaluate_model(trained: TrainResult, manifest: Path, training: TrainingSpec,
                   mlflow_run_id: str) -> Evaluation:
    """Evaluate the best weights on the test split, once per image, and log the results."""
    logger = run_logger()
    job = TrainJob(manifest=manifest, training=training, output_dir=trained.output_dir)
    out = trained.output_dir.parent / "evaluation"
    metrics = evaluate(job, trained.weights, out)
    training_curves_png(trained.history, out / "training_curves.png")
    scalars = {k: v for k, v in metrics.items() if isinstance(v, float)}
    client = MlflowClient(tracking_uri())
    now = int(time.time() * 1000)
    client.log_batch(mlflow_run_id,
                     metrics=[Metric(f"test_{name}", value, now, 0)
                              for name, value in {**scalars, "images": metrics["images"]}.items()],
                     params=[Param("best_epoch", str(trained.best_epoch))])
    client.log_artifacts(mlflow_run_id, str(out), artifact_path="evaluation")
    logger.info("test metrics on %d images: %s", metrics["images"],
                " ".join(f"{k}={v:.4f}" for k, v in scalars.items()))
    return Evaluation(metrics=scalars, per_class=metrics["per_class"], output_dir=out,
                      predictions=out / "predictions.csv")
