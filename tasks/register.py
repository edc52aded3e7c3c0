"""register_model: log the model to MLflow, register a version, judge it by the gate's policy
(tasks/decision.py) against the current champion on the same images, and record the decision."""

from __future__ import annotations

import contextlib
import csv
import json
from datetime import UTC, datetime
from pathlib import Path

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from prefect import task

from tasks import MLFLOW_RETRIES, run_logger
from tasks.decision import (
    Registration,
    beats_chance,
    decide,
    mcnemar_p_value,
    small_test_warning,
)
from tasks.evaluate import Evaluation
from tasks.gate import champion_class_names, one_decision_at_a_time, score_champion
from tasks.lineage import CHALLENGER, CHAMPION, FLOW_RUN_ID, champion_version, metric_tag
from tasks.packaging import log_model
from tasks.tracking import fluent_mlflow
from training.config import RegistrySpec
from training.handoff import TrainResult
from training.storage import tracking_uri

METRIC = "trainflow.metric"
PREDICTIONS_RUN_ID = "trainflow.predictions_run_id"
PROMOTION = "trainflow.promotion"
PROMOTION_REASON = "trainflow.promotion_reason"
CHAMPION_VALUE = "trainflow.champion_value_at_decision"
"""The champion's metric on the challenger's test images, at the decision."""
COMPARED_WITH = "trainflow.compared_with_version"
COMPARED_IMAGES = "trainflow.compared_images"
MCNEMAR_P_VALUE = "trainflow.mcnemar_p_value"
DECIDED_AT = "trainflow.decided_at"
"""When the gate decided, ISO 8601 in UTC to the microsecond (2026-12-07T18:52:03.123456+00:00,
as the MLflow UI shows it); decisions replay in this order (`decided_at`)."""
APPROVAL = "trainflow.approval"
"""auto, or a person's answer: approved / rejected / no answer, with their comment"""
TEST_METRICS = "trainflow.test_metrics"


CARD_MARKER = "\n\n---\n"
"""Between the gate's sentence and the model card in a version's description."""


def decided_at(tags: dict[str, str]) -> datetime:
    """A version's DECIDED_AT, written as ISO 8601 or, by older versions, as Unix seconds."""
    value = tags[DECIDED_AT]
    try:
        return datetime.fromtimestamp(float(value), UTC)
    except ValueError:
        return datetime.fromisoformat(value)


def correctness(predictions: Path) -> dict[str, int]:
    """path -> 1 if right, from the evaluation's predictions.csv."""
    with open(predictions, newline="") as f:
        return {row["path"]: int(row["correct"]) for row in csv.DictReader(f)}


def judge(trained: TrainResult, evaluation: Evaluation, registry: RegistrySpec, version: str,
          champion, logger) -> Registration:
    """The gate's decision against `champion` (the current one, or None), on the same images."""
    metric, value = registry.metric, evaluation.metrics[registry.metric]
    warning = small_test_warning(evaluation)
    common = {"model_name": registry.model_name, "version": version, "aliases": [],
              "metric": metric, "value": value, "warning": warning}
    if champion is not None and registry.promote:
        theirs = champion_class_names(registry.model_name, champion.version)
        if theirs != trained.class_names:
            # Scores over different label sets measure different tasks: never compared blindly.
            return Registration(**common, promoted=False, champion_version=str(champion.version),
                                reason=f"champion v{champion.version} predicts the classes "
                                f"{theirs}, this data has {trained.class_names}: not compared, "
                                "so not promoted automatically; make it champion by hand with "
                                f"`trainflow champion {registry.model_name} {version}`")
    same = (score_champion(champion, trained.job.split, trained.job.training, logger)
            if champion and registry.promote else None)
    p_value = None
    if same is not None and registry.significance is not None:
        p_value = mcnemar_p_value(correctness(evaluation.predictions), same.correct)
    promoted, reason = decide(registry, value, same, p_value,
                              beats_chance(evaluation, registry.significance))
    manual = promoted and registry.approval == "manual"
    return Registration(**common, promoted=promoted and not manual, awaiting_approval=manual,
                        reason=reason, p_value=p_value,
                        champion_version=same.version if same else None,
                        champion_value=same.metrics[metric] if same else None,
                        compared_images=same.images if same else None)


def record(client: MlflowClient, registration: Registration, approval: str) -> Registration:
    """The decision on the version (tags and description), then the aliases it earned."""
    r = registration
    tags = {PROMOTION: "promoted" if r.promoted else "not promoted", PROMOTION_REASON: r.reason,
            APPROVAL: approval,
            DECIDED_AT: datetime.now(UTC).isoformat(timespec="microseconds")}
    if r.champion_version is not None:
        tags[COMPARED_WITH] = r.champion_version
    if r.champion_value is not None:
        tags[CHAMPION_VALUE] = repr(r.champion_value)
        tags[COMPARED_IMAGES] = str(r.compared_images)
    if r.p_value is not None:
        tags[MCNEMAR_P_VALUE] = repr(r.p_value)
    for key, tag in tags.items():
        client.set_model_version_tag(r.model_name, r.version, key, tag)
    # The model card below the sentence (tasks/review.py) stays when the decision changes.
    old = client.get_model_version(r.model_name, r.version).description or ""
    card = old[old.index(CARD_MARKER):] if CARD_MARKER in old else ""
    client.update_model_version(r.model_name, r.version, description=r.description() + card)
    if r.promoted:
        client.set_registered_model_alias(r.model_name, CHAMPION, r.version)
    aliases = client.get_model_version(r.model_name, r.version).aliases
    return r.model_copy(update={"aliases": sorted(aliases)})


@task(**MLFLOW_RETRIES)
def register_model(trained: TrainResult, evaluation: Evaluation, registry: RegistrySpec,
                   mlflow_run_id: str, lineage: dict[str, str]) -> Registration:
    """Register a version (once per flow run); move `champion` only for a better model."""
    # Logging the model, registering it and loading the champion go through MLflow's fluent
    # API and models:/ URIs, which read the global tracking URI.
    with fluent_mlflow(tracking_uri()):
        return _register(trained, evaluation, registry, mlflow_run_id, lineage)


def _register(trained: TrainResult, evaluation: Evaluation, registry: RegistrySpec,
              mlflow_run_id: str, lineage: dict[str, str]) -> Registration:
    logger = run_logger()
    client = MlflowClient(tracking_uri())
    name, metric = registry.model_name, registry.metric
    value = evaluation.metrics[metric]
    with contextlib.suppress(MlflowException):  # it exists already
        client.create_registered_model(name)
    found = client.search_model_versions(
        f"name='{name}' and tags.`{FLOW_RUN_ID}`='{lineage[FLOW_RUN_ID]}'")
    if found:  # a retried task: the version exists, only the gate may be missing
        version = found[0]
        logger.info("version %s already registered for this flow run", version.version)
    else:
        tags = {**lineage, METRIC: metric, PREDICTIONS_RUN_ID: mlflow_run_id,
                metric_tag(metric): repr(value), TEST_METRICS: json.dumps(evaluation.metrics)}
        model = log_model(trained, mlflow_run_id)
        # What mlflow.register_model does for a models:/ URI, without the two lines it prints
        # to stderr ("... already exists", "Created version N"), which the summary says.
        version = client.create_model_version(name, model.model_uri, tags=tags,
                                              model_id=model.model_id)
    with one_decision_at_a_time(name):
        if PROMOTION in version.tags:  # decided by an earlier attempt: never judged again
            registration = recorded(version, registry, value, small_test_warning(evaluation))
        else:
            registration = judge(trained, evaluation, registry, str(version.version),
                                 champion_version(client, name), logger)
            registration = record(client, registration, "auto" if registry.approval == "auto"
                                  else "waiting" if registration.awaiting_approval
                                  else "not asked")
        client.set_registered_model_alias(name, CHALLENGER, version.version)
    # The description ends with the warning, if any: one line, at the level it deserves.
    (logger.warning if registration.warning else logger.info)("%s", registration.description())
    return registration.model_copy(update={"aliases": sorted(
        client.get_model_version(name, registration.version).aliases)})


def recorded(version, registry: RegistrySpec, value: float, warning: str | None
             ) -> Registration:
    """The decision an earlier attempt recorded on `version` (a retried task)."""
    tags = version.tags

    def number(key: str, kind=float):
        return kind(float(tags[key])) if key in tags else None

    return Registration(model_name=registry.model_name, version=str(version.version),
                        aliases=[], promoted=tags[PROMOTION] == "promoted",
                        reason=tags.get(PROMOTION_REASON, ""), metric=registry.metric,
                        value=value, champion_version=tags.get(COMPARED_WITH),
                        champion_value=number(CHAMPION_VALUE),
                        compared_images=number(COMPARED_IMAGES, int),
                        p_value=number(MCNEMAR_P_VALUE), warning=warning,
                        awaiting_approval=tags.get(APPROVAL) == "waiting")


