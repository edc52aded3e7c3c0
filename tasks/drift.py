"""Drift of what the champion scores: the reference recorded with each version, and the check
predict-flow makes of every batch against its model's reference.

The reference is the version's own test split (training/evaluation/drift.py), logged to the
version's MLflow run as `drift/reference.json` when it is registered. A batch that drifts
raises a `trainflow.scoring.drift` event: what follows is the team's choice, a notification
(`trainflow notify`) or a retrain (a deployment trigger, prefect.yaml).
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from prefect import task
from prefect.events import emit_event

from tasks import MLFLOW_RETRIES, run_logger
from tasks.evaluate import Evaluation
from tasks.score import Scores, ScoringModel
from training.config import DriftSpec
from training.data.rows import image_bytes
from training.evaluation.drift import STATISTICS, Drift, Sample, compare, image_statistics
from training.handoff import SplitResult
from training.storage import tracking_uri, write_text_atomic

REFERENCE = "drift/reference.json"
"""The reference's artifact path in a version's MLflow run"""
EVENT = "trainflow.scoring.drift"


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@task(**MLFLOW_RETRIES)
def record_drift_reference(split: SplitResult, evaluation: Evaluation, mlflow_run_id: str
                           ) -> Path:
    """The version's test split as predict-flow will see a batch, logged to its MLflow run."""
    rows = _rows(evaluation.predictions)
    every = -(-len(rows) // DriftSpec().statistics_images)  # as predict-flow samples a batch
    statistics = [image_statistics(image_bytes(split.root / r["path"])) for r in rows[::every]]
    reference = Sample.of([r["predicted"] for r in rows],
                          [float(r["probability"]) for r in rows], statistics)
    path = evaluation.output_dir.parent / "drift" / "reference.json"
    write_text_atomic(path, reference.model_dump_json())
    MlflowClient(tracking_uri()).log_artifact(mlflow_run_id, str(path), artifact_path="drift")
    run_logger().info("drift reference: %d test images", len(rows))
    return path


def batch_sample(scores: Scores) -> Sample:
    """A scored batch as a Sample: its readable images' predictions and statistics."""
    predicted = [r for r in _rows(scores.predictions) if not r["error"]]
    measured = _rows(scores.statistics) if scores.statistics else []
    return Sample.of([r["label"] for r in predicted], [float(r["probability"]) for r in predicted],
                     [tuple(float(r[name]) for name in STATISTICS) for r in measured])


def read_reference(model: ScoringModel, folder: Path) -> Sample | None:
    """The reference recorded with the model's version; None for a version registered before
    references were recorded."""
    try:
        path = mlflow.artifacts.download_artifacts(run_id=model.run_id, artifact_path=REFERENCE,
                                                   dst_path=str(folder),
                                                   tracking_uri=tracking_uri())
    except (MlflowException, OSError):
        return None
    return Sample.model_validate_json(Path(path).read_text())


@task(**MLFLOW_RETRIES)
def check_drift(model: ScoringModel, scores: Scores, spec: DriftSpec, folder: Path
                ) -> Drift | None:
    """Compare the batch with the version's test split; record it on the batch's MLflow run,
    and raise the event when it drifted."""
    logger = run_logger()
    reference = read_reference(model, folder)
    if reference is None:
        logger.warning("%s (v%s) has no drift reference (registered before they were "
                       "recorded): drift not checked; a retrain records one", model.uri,
                       model.version)
        return None
    drift = compare(reference, batch_sample(scores), spec)
    client = MlflowClient(tracking_uri())
    now = int(time.time() * 1000)
    client.log_batch(scores.mlflow_run_id, metrics=[
        Metric("drift", float(drift.drifted), now, 0),
        *(Metric(f"drift_{t.name}_effect", t.effect, now, 0) for t in drift.tests),
        *(Metric(f"drift_{t.name}_p_value", t.p_value, now, 0) for t in drift.tests)])
    path = folder / "drift.json"
    write_text_atomic(path, drift.model_dump_json(indent=2))
    client.log_artifact(scores.mlflow_run_id, str(path), artifact_path="drift")
    if drift.drifted:
        emit_event(
            event=EVENT,
            resource={"prefect.resource.id": f"trainflow.model.{model.name}",
                      "prefect.resource.name": model.name,
                      "trainflow.model": model.name, "trainflow.model_version": model.version},
            payload={"drifted": drift.drifted_tests, "batch_images": drift.batch_images,
                     "mlflow_run_id": scores.mlflow_run_id,
                     "tests": json.loads(drift.model_dump_json())["tests"]})
        logger.warning("the batch drifted from %s's test split: %s", model.uri, ", ".join(
            f"{t.name} (effect {t.effect:.3f}, p={t.p_value:.2g})"
            for t in drift.tests if t.drifted))
    else:
        logger.info("no drift from %s's test split (%d tests at p < %.2g, effect >= %.2f)",
                    model.uri, len(drift.tests), drift.level, spec.min_effect)
    return drift
