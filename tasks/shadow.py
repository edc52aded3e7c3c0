"""Shadow scoring: the newest challenger scores predict-flow's batch beside the champion.

Only the champion's predictions are written; the challenger's agreement with them (per class,
and the images where they differ) goes to the batch's MLflow run, and adds up on the
challenger's version as its shadow record (`trainflow champion MODEL` shows it), so that a
person deciding to promote it sees how it behaved on production images, not only on a test
split.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from prefect import task

from tasks import MLFLOW_RETRIES, run_logger
from tasks.gate import one_decision_at_a_time
from tasks.lineage import CHALLENGER
from tasks.score import Images, Scores, ScoringModel, resolve_model, score_files
from training.config import TrainingSpec
from training.evaluation.shadow import Shadow, agreement
from training.storage import tracking_uri

SHADOW_RECORD = "trainflow.shadow"
"""A version's tag: its shadow record against the champion, as JSON"""


@task
def resolve_shadow(champion: ScoringModel, folder: Path) -> ScoringModel | None:
    """models:/NAME@challenger (the newest version registered), unless it is the champion."""
    client = MlflowClient(tracking_uri())
    try:
        newest = client.get_model_version_by_alias(champion.name, CHALLENGER)
    except MlflowException:
        newest = None
    if newest is None or str(newest.version) == champion.version:
        run_logger().info("no challenger to shadow: the newest version of %s is the champion",
                          champion.name)
        return None
    return resolve_model.fn(champion.name, CHALLENGER, folder)


def shadow_record(client: MlflowClient, name: str, version: str) -> dict | None:
    tags = client.get_model_version(name, version).tags
    return json.loads(tags[SHADOW_RECORD]) if SHADOW_RECORD in tags else None


@task(**MLFLOW_RETRIES)
def shadow_score(champion: ScoringModel, challenger: ScoringModel, images: Images,
                 scores: Scores, out: Path, num_processes: int | str = "auto") -> Shadow:
    """Score the batch with the challenger too, compare, and record the agreement."""
    logger = run_logger()
    spec = TrainingSpec(num_processes=num_processes)  # only its launch fields are used
    scored = score_files(challenger.local_path, images.paths, images.root, out, spec, logger)
    shadow = agreement(scores.predictions, scored.predictions,
                       (champion.version, challenger.version), out / "differences.csv")
    client = MlflowClient(tracking_uri())
    now = int(time.time() * 1000)
    client.log_batch(scores.mlflow_run_id, metrics=[
        Metric("shadow_agreement", shadow.overall.share, now, 0),
        Metric("shadow_images", shadow.overall.images, now, 0),
        *(Metric(f"shadow_agreement_{label}", figures.share, now, 0)
          for label, figures in shadow.per_class.items())])
    summary = out / "shadow.json"
    summary.write_text(shadow.model_dump_json(indent=2))
    for file in (summary, shadow.differences):
        client.log_artifact(scores.mlflow_run_id, str(file), artifact_path="shadow")
    client.set_tag(scores.mlflow_run_id, "trainflow.shadow_version", challenger.version)
    # Batches scored at once add to one record: under the gate's slot for the model name.
    with one_decision_at_a_time(champion.name):
        record = shadow_record(client, champion.name, challenger.version)
        if record is None or record["champion"] != champion.version:
            record = {"champion": champion.version, "batches": 0, "images": 0, "agreeing": 0}
        record.update(batches=record["batches"] + 1,
                      images=record["images"] + shadow.overall.images,
                      agreeing=record["agreeing"] + shadow.overall.agreeing,
                      last_run=scores.mlflow_run_id)
        client.set_model_version_tag(champion.name, challenger.version, SHADOW_RECORD,
                                     json.dumps(record))
    logger.info("shadow: challenger v%s agrees with champion v%s on %d of %d images (%.1f%%); "
                "%d differences in MLflow (shadow/differences.csv)", challenger.version,
                champion.version, shadow.overall.agreeing, shadow.overall.images,
                100 * shadow.overall.share, shadow.overall.images - shadow.overall.agreeing)
    return shadow
