"""evaluate_model: test-split metrics and pictures, logged to the flow's MLflow run."""

from __future__ import annotations

import time
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from prefect import task
from pydantic import BaseModel

from runtime.launcher import launch
from runtime.progress_display import LaunchProgress
from runtime.remote import publish_run_outputs, remote_root
from tasks import MLFLOW_RETRIES, RESUMABLE, run_logger
from tasks.train import evaluation_dir
from training.engine.events import ClassFigures, Predicted, TestMetrics, last_from_rank_0
from training.evaluation.plots import training_curves_png
from training.handoff import TrainResult
from training.storage import tracking_uri


class Evaluation(BaseModel):
    metrics: dict[str, float]
    """accuracy, loss, macro_f1 (and roc_auc for two classes) on the test split"""
    per_class: dict[str, ClassFigures]
    images: int
    output_dir: Path
    predictions: Path


def run_evaluation(trained: TrainResult, out: Path, logger) -> Evaluation:
    """The test split's metrics and pictures in `out`, the one way: the ranks predict (the
    training's own launch when it did, else `accelerate launch -m training.evaluate
    --predictions-only` on the training's world, with the same guarantees), and this process
    computes the metrics and draws the pictures from the predictions (write_results)."""
    # Here, not at the top: the flow's process imports torch only once a stage needs it.
    from training.evaluate import LOGITS, summarize, write_results

    if trained.test_dir == out and (out / LOGITS).exists():
        logger.info("the training launch predicted the test split with the best weights")
    else:
        args = ["--job", str(trained.output_dir / "job.json"), "--weights",
                str(trained.weights), "--out", str(out), "--predictions-only"]
        progress = LaunchProgress(logger)
        try:
            events = launch(trained.job.training.on_this_machine(), "training.evaluate", args,
                            out, logger, on_event=progress.on_event)
        finally:
            progress.close()
        if last_from_rank_0(events, Predicted) is None:
            raise RuntimeError("evaluation exited cleanly but rank 0 reported no predictions")
    metrics = TestMetrics.model_validate(summarize(write_results(trained.job, out)))
    return Evaluation(metrics=metrics.scores(), per_class=metrics.per_class,
                      images=metrics.images, output_dir=out,
                      predictions=out / "predictions.csv")


@task(**RESUMABLE, **MLFLOW_RETRIES)
def evaluate_model(trained: TrainResult, mlflow_run_id: str) -> Evaluation:
    """Evaluate the best weights on the test split, once per image, and log the results."""
    logger = run_logger()
    out = evaluation_dir(trained.job)
    evaluation = run_evaluation(trained, out, logger)
    training_curves_png(trained.history, out / "training_curves.png")
    client = MlflowClient(tracking_uri())
    now = int(time.time() * 1000)
    client.log_batch(mlflow_run_id,
                     metrics=[Metric(f"test_{name}", value, now, 0) for name, value in
                              {**evaluation.metrics, "images": evaluation.images}.items()],
                     params=[Param("best_epoch", str(trained.best_epoch))])
    for file in sorted(out.glob("*.*")):  # the results, not the ranks' progress/ folder
        client.log_artifact(mlflow_run_id, str(file), artifact_path="evaluation")
    logger.info("test metrics on %d images: %s", evaluation.images,  # as the epoch lines
                " ".join(f"{name}={value:.4g}" for name, value in evaluation.metrics.items()))
    if (remote := remote_root()) is not None:  # for a retry on another machine
        publish_run_outputs(remote, out)
    return evaluation
