"""register_model: log the model to MLflow, register a version, and run the champion gate."""

from __future__ import annotations

import contextlib
import csv
import json
import tempfile
from pathlib import Path

import mlflow
import torch
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from prefect import task
from pydantic import BaseModel

from tasks import run_logger
from tasks.evaluate import Evaluation
from tasks.lineage import CHALLENGER, CHAMPION, FLOW_RUN_ID, champion_version, metric_tag
from training.config import RegistrySpec
from training.data.split import read_manifest
from training.handoff import TrainResult
from training.models.build import DESCRIPTION_ARTIFACT, WEIGHTS_ARTIFACT
from training.storage import tracking_uri

TRAINING_DIR = Path(__file__).resolve().parents[1] / "training"
SERVED_MODEL = TRAINING_DIR / "models" / "image_classifier.py"
METRIC = "trainflow.metric"
PREDICTIONS_RUN_ID = "trainflow.predictions_run_id"
PROMOTION = "trainflow.promotion"
PROMOTION_REASON = "trainflow.promotion_reason"
CHAMPION_VALUE = "trainflow.champion_value_at_decision"
MCNEMAR_P_VALUE = "trainflow.mcnemar_p_value"
TEST_METRICS = "trainflow.test_metrics"
# Below this many test images in a class, a few images' difference is noise.
MIN_TEST_IMAGES_PER_CLASS = 30


class Registration(BaseModel):
    model_name: str
    version: str
    aliases: list[str]
    promoted: bool
    reason: str
    metric: str
    value: float
    champion_value: float | None = None
    p_value: float | None = None
    warning: str | None = None


def log_model(trained: TrainResult, run_id: str) -> str:
    """Log the model from code (training/models/image_classifier.py), nothing of ours pickled.

    Weights go as a safetensors artifact, the model's description as JSON, and training/ as
    code, so the served model decodes and resizes with training's own function.
    """
    import pandas as pd
    import torchvision
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    names = trained.class_names
    description = {"model": trained.job.training.model, "class_names": names,
                   "preprocessing": trained.preprocessing.model_dump()}
    signature = ModelSignature(
        inputs=Schema([ColSpec("binary", "image")]),
        outputs=Schema([ColSpec("string", "label", required=False),
                        ColSpec("double", "probability", required=False),
                        *[ColSpec("double", f"probability_{c}", required=False) for c in names],
                        ColSpec("string", "error", required=False)]))
    example_file = next(trained.job.split.root / path for path, _, split in
                        read_manifest(trained.job.split.manifest) if split == "test")
    with tempfile.TemporaryDirectory() as tmp, \
            mlflow.start_run(run_id=run_id, nested=mlflow.active_run() is not None):
        description_file = Path(tmp) / "description.json"
        description_file.write_text(json.dumps(description, indent=2))
        model_info = mlflow.pyfunc.log_model(
            name="model", python_model=str(SERVED_MODEL), code_paths=[str(TRAINING_DIR)],
            artifacts={WEIGHTS_ARTIFACT: str(trained.weights),
                       DESCRIPTION_ARTIFACT: str(description_file)},
            signature=signature, metadata=description,
            input_example=pd.DataFrame({"image": [example_file.read_bytes()]}),
            # Explicit requirements: inferring them starts a subprocess that imports the model.
            pip_requirements=[f"mlflow=={mlflow.__version__}",
                              f"torch=={torch.__version__.split('+')[0]}",
                              f"torchvision=={torchvision.__version__.split('+')[0]}",
                              "safetensors", "pillow", "numpy", "pandas", "pydantic"],
        )
    return model_info.model_uri


def mcnemar_p_value(ours: Path, theirs: Path) -> float:
    """Exact McNemar test on two models' correctness over the same test images."""
    from scipy.stats import binomtest

    def correct(path: Path) -> dict[str, int]:
        with open(path, newline="") as f:
            return {row["path"]: int(row["correct"]) for row in csv.DictReader(f)}

    a, b = correct(ours), correct(theirs)
    common = a.keys() & b.keys()
    only_ours = sum(1 for p in common if a[p] and not b[p])
    only_theirs = sum(1 for p in common if b[p] and not a[p])
    if only_ours + only_theirs == 0:
        return 1.0
    return float(binomtest(only_ours, only_ours + only_theirs, 0.5).pvalue)


def beats_chance(evaluation: Evaluation, level: float | None) -> tuple[bool, str]:
    """Does the model beat always predicting the test split's majority class?

    By its accuracy, and (at `level`) by a one-sided binomial test, so that a model that is
    right by luck on a small test split is not taken for one that learned.
    """
    from scipy.stats import binomtest

    n = evaluation.images
    majority = max(c["support"] for c in evaluation.per_class.values()) / n
    correct = round(evaluation.metrics["accuracy"] * n)
    p = float(binomtest(correct, n, majority, alternative="greater").pvalue)
    ok = correct / n > majority and (level is None or p < level)
    return ok, (f"test accuracy {correct / n:.4f} against {majority:.4f} for always predicting "
                f"the majority class (binomial p={p:.3g})")


def small_test_warning(evaluation: Evaluation) -> str | None:
    smallest, name = min((c["support"], k) for k, c in evaluation.per_class.items())
    if smallest >= MIN_TEST_IMAGES_PER_CLASS:
        return None
    return (f"the test split has only {smallest} images of class {name!r}: differences of a "
            "few images between models cannot be told from noise; raise split.test_fraction "
            "or add images")


def decide(spec: RegistrySpec, value: float, champion, p_value: float | None,
           chance: tuple[bool, str]) -> tuple[bool, str]:
    if not spec.promote:
        return False, "promotion disabled (registry.promote=false)"
    beats, versus = chance
    if not beats:
        return False, f"no better than chance: {versus}"
    if champion is None:
        return True, "no champion yet"
    best = float(champion.tags[metric_tag(spec.metric)])
    gain = value - best
    if gain <= 0 or gain < spec.min_improvement:
        return False, (f"test_{spec.metric} {value:.4f} does not beat champion v{champion.version} "
                       f"({best:.4f}) by at least {spec.min_improvement:g}")
    if spec.significance is not None and p_value is not None and p_value >= spec.significance:
        return False, (f"gain {gain:+.4f} over v{champion.version} is not significant "
                       f"(McNemar p={p_value:.3g} >= {spec.significance:g}): it may be noise")
    return True, f"test_{spec.metric} {value:.4f} beats champion v{champion.version} ({best:.4f})"


@task(retries=2, retry_delay_seconds=3)
def register_model(trained: TrainResult, evaluation: Evaluation, registry: RegistrySpec,
                   mlflow_run_id: str, lineage: dict[str, str]) -> Registration:
    """Register a version (once per flow run) and move `champion` only for a better model."""
    logger = run_logger()
    mlflow.set_tracking_uri(tracking_uri())  # the fluent API below reads the global URI
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
        model_uri = log_model(trained, mlflow_run_id)
        tags = {**lineage, METRIC: metric, PREDICTIONS_RUN_ID: mlflow_run_id,
                metric_tag(metric): repr(value), TEST_METRICS: json.dumps(evaluation.metrics)}
        version = mlflow.register_model(model_uri, name, tags=tags)

    champion = champion_version(client, name)
    p_value = None
    if registry.significance is not None and champion is not None:
        theirs = Path(client.download_artifacts(champion.tags[PREDICTIONS_RUN_ID],
                                                "evaluation/predictions.csv"))
        p_value = mcnemar_p_value(evaluation.predictions, theirs)
    promoted, reason = decide(registry, value, champion, p_value,
                              beats_chance(evaluation, registry.significance))
    if warning := small_test_warning(evaluation):
        logger.warning("%s", warning)
    champion_value = float(champion.tags[metric_tag(metric)]) if champion is not None else None
    # The decision is tagged before the alias moves, so that a concurrent promoter's
    # reconciliation below can already see it.
    for key, tag in {PROMOTION: "promoted" if promoted else "not promoted",
                     PROMOTION_REASON: reason, CHAMPION_VALUE: repr(champion_value),
                     MCNEMAR_P_VALUE: repr(p_value)}.items():
        client.set_model_version_tag(name, version.version, key, tag)
    client.update_model_version(name, version.version, description=(
        f"v{version.version} {'became champion' if promoted else 'was not promoted'}: {reason}."
        + (f" Warning: {warning}." if warning else "")))
    client.set_registered_model_alias(name, CHALLENGER, version.version)
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, version.version)
        keep_best_champion(client, name, metric)
    aliases = client.get_model_version(name, version.version).aliases
    logger.info("%s v%s: %s (%s)", name, version.version,
                "promoted to champion" if promoted else "challenger", reason)
    return Registration(model_name=name, version=str(version.version), aliases=list(aliases),
                        promoted=promoted, reason=reason, metric=metric, value=value,
                        champion_value=champion_value, p_value=p_value, warning=warning)


def keep_best_champion(client: MlflowClient, name: str, metric: str) -> None:
    """After a promotion, hand `champion` to the best promoted version on record.

    Two runs can read the same old champion and both decide to promote; whichever sets the
    alias last would win, worse or not. Each promoter tags its decision before moving the
    alias and reconciles after it, so the last one to reconcile sees every promotion and the
    better model ends as champion, judged by the metric recorded on each version.
    """
    promoted = client.search_model_versions(f"name='{name}' and tags.`{PROMOTION}`='promoted'")
    if not promoted:
        return
    best = max(promoted, key=lambda v: (float(v.tags.get(metric_tag(metric), "-inf")),
                                        int(v.version)))
    holder = champion_version(client, name)
    if holder is None or str(holder.version) != str(best.version):
        client.set_registered_model_alias(name, CHAMPION, best.version)
