"""The champion/challenger gate's evidence: the current champion scored on the challenger's
test images, one decision per model name at a time.

A champion's own test figure was measured on its own test split; when data grows, that split
changes, and comparing a challenger with it compares two different exams (measured: v1 scored
0.575 on its test split and 0.309 on v2's). So, before each decision, the current champion
scores the challenger's test images through predict-flow's path (`score_files`, the served
model under `accelerate launch`, or in one process for a few images). Its predictions are
cached per (champion version, test set): a run whose test split did not change scores nothing
again.

Reading the champion, scoring, deciding and moving the alias happen under one Prefect global
concurrency limit per model name, so that two runs finishing together are judged one after the
other, each against the champion that really was current.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from prefect import task
from pydantic import BaseModel

from tasks import run_logger
from tasks.lineage import champion_version
from tasks.score import score_files
from training.config import RegistrySpec, TrainingSpec
from training.data.split import read_manifest
from training.handoff import SplitResult
from training.storage import file_lock, home, tracking_uri

# Below this many test images the champion scores them in one plain process: measured on 2
# CPU cores, `accelerate launch` with two ranks took 24.6 s to score 179 digits, nearly all of
# it the launcher's and the ranks' start-up, which sharing so few images out cannot repay.
ONE_PROCESS_BELOW = 2000

# The early scoring runs beside ranks that already hold every core (runtime/launcher.py shares
# the cores out among them). torch's default of a thread per core asked for more threads than
# the machine has: on 2 cores the scoring took 15.0 s beside the training, 11.8 s with one.
BESIDE_TRAINING = {"OMP_NUM_THREADS": "1"}


class SameImages(BaseModel):
    """The champion's figures on the challenger's test images."""

    version: str
    images: int
    metrics: dict[str, float]
    """accuracy, macro_f1 (and roc_auc for two classes), as the challenger's are computed"""
    correct: dict[str, int]
    """test image path -> 1 if the champion labelled it right"""
    cached: bool


def limit_name(model_name: str) -> str:
    """A concurrency limit name for any registered model name (MLflow allows more characters)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", model_name)[:60]
    return f"trainflow-gate-{safe}-{hashlib.sha256(model_name.encode()).hexdigest()[:8]}"


@contextlib.contextmanager
def one_decision_at_a_time(model_name: str) -> Iterator[None]:
    """Hold the model name's gate slot: a Prefect global concurrency limit of 1, created on
    first use (the UI lists it under Concurrency)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectNotFound

    name = limit_name(model_name)
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=1))
            except Exception:  # created by another run at the same moment (the server's 409/500)
                client.read_global_concurrency_limit_by_name(name)
    with concurrency(name, occupy=1, strict=True):
        yield


def test_rows(split: SplitResult) -> list[tuple[str, str]]:
    """(path, label) of every test image, in manifest order."""
    return [(p, label) for p, label, side in read_manifest(split.manifest) if side == "test"]


def test_set_key(rows: list[tuple[str, str]]) -> str:
    return hashlib.sha256("".join(f"{p}\t{label}\n" for p, label in sorted(rows)).encode()
                          ).hexdigest()[:16]


def champion_class_names(model_name: str, version: str) -> list[str] | None:
    metadata = mlflow.models.get_model_info(f"models:/{model_name}/{version}").metadata or {}
    return metadata.get("class_names")


def predictions_folder(champion, rows: list[tuple[str, str]]) -> Path:
    """Where the gate keeps a champion version's predictions on one test set."""
    key = hashlib.sha256(f"{tracking_uri()}|{champion.name}|{champion.version}|"
                         f"{champion.run_id}".encode()).hexdigest()[:16]
    return home() / "gate" / key / test_set_key(rows)


def champion_predictions(model_name: str, version: str, split: SplitResult) -> Path | None:
    """The predictions the gate scored for champion `version` on `split`'s test images, if it
    did (it does not when the classes differ or promotion is off)."""
    champion = MlflowClient(tracking_uri()).get_model_version(model_name, version)
    predictions = predictions_folder(champion, test_rows(split)) / "predictions.csv"
    return predictions if predictions.is_file() else None


def score_champion(champion, split: SplitResult, training: TrainingSpec, logger,
                   same_classes_only: bool = False, beside_training: bool = False
                   ) -> SameImages | None:
    """The champion's predictions on the challenger's test images, scored once per test set.

    `same_classes_only`: None, and nothing scored, when the champion predicts other classes
    than the split's (the gate does not compare those). `beside_training`: the ranks hold every
    core, so the scoring takes one thread (BESIDE_TRAINING)."""
    rows = test_rows(split)
    folder = predictions_folder(champion, rows)
    predictions = folder / "predictions.csv"
    folder.mkdir(parents=True, exist_ok=True)
    # One scoring per folder at a time: the early scoring and the gate, or two runs on the
    # same data, then find the other's predictions instead of downloading over them.
    with file_lock(folder / "lock"):
        cached = predictions.exists()
        if cached:
            logger.info("champion v%s's predictions on these %d test images are cached",
                        champion.version, len(rows))
        else:
            # Resolved here, not through a models:/ URI: MLflow resolves those with its global
            # registry URI, which the training thread sets and resets meanwhile.
            uri = tracking_uri()
            model_dir = mlflow.artifacts.download_artifacts(
                artifact_uri=MlflowClient(uri).get_model_version_download_uri(
                    champion.name, champion.version),
                dst_path=str(folder / "model"), tracking_uri=uri)
            described = mlflow.models.Model.load(model_dir).metadata or {}
            if same_classes_only and described.get("class_names") != split.class_names:
                return None
            scored = score_files(Path(model_dir), [split.root / p for p, _ in rows], split.root,
                                 folder, training, logger,
                                 one_process=len(rows) < ONE_PROCESS_BELOW,
                                 extra_env=BESIDE_TRAINING if beside_training else None)
            logger.info("champion v%s scored the challenger's %d test images in %.1f s "
                        "(%d process%s)", champion.version, scored.images, scored.seconds,
                        scored.world_size, "" if scored.world_size == 1 else "es")
    with open(predictions, newline="") as f:
        predicted = {r["path"]: r for r in csv.DictReader(f)}
    return SameImages(version=str(champion.version), images=len(rows), cached=cached,
                      **figures(rows, predicted, split.class_names))


@task
def score_champion_early(split: SplitResult, training: TrainingSpec, registry: RegistrySpec
                         ) -> str | None:
    """The current champion scored on this run's test images while the challenger trains, into
    the gate's cache, so that the gate after training finds its predictions ready.

    Only a one-process scoring (a few test images) starts early: under `accelerate launch` it
    would take every GPU from the training. The gate still decides against whichever version is
    champion when it decides, and scores that one if it is another. Returns the version scored.
    """
    logger = run_logger()
    rows = test_rows(split)
    if not registry.promote or len(rows) >= ONE_PROCESS_BELOW:
        return None
    # Explicit tracking URIs only, never MLflow's fluent state: the training in this process's
    # main thread sets and resets that meanwhile.
    try:
        champion = champion_version(MlflowClient(tracking_uri()), registry.model_name)
        if champion is None or score_champion(champion, split, training, logger,
                                              same_classes_only=True,
                                              beside_training=True) is None:
            return None
    except Exception as e:  # the gate scores it itself, and says why if it cannot
        logger.warning("the champion could not be scored while training (%s: %s); the gate "
                       "will score it after training", type(e).__name__, str(e)[:300])
        return None
    return str(champion.version)


def figures(rows: list[tuple[str, str]], predicted: dict[str, dict], class_names: list[str]
            ) -> dict:
    """The figures the challenger's evaluation computes, from a served model's predictions.

    An image the champion could not read counts as wrong.
    """
    from sklearn.metrics import accuracy_score, f1_score, recall_score, roc_auc_score

    from training.evaluation.metrics import balanced_recall

    index = {name: k for k, name in enumerate(class_names)}
    y_true = [index[label] for _, label in rows]
    y_pred = [index.get(predicted[p]["label"] or "", -1) for p, _ in rows]
    k = list(range(len(class_names)))
    recall = recall_score(y_true, y_pred, labels=k, average=None, zero_division=0)
    metrics = {"accuracy": float(accuracy_score(y_true, y_pred)),
               "balanced_accuracy": balanced_recall(recall, [y_true.count(c) for c in k]),
               "macro_f1": float(f1_score(y_true, y_pred, labels=k, average="macro",
                                          zero_division=0))}
    if len(class_names) == 2:
        positive = f"probability_{class_names[1]}"
        scores = [float(predicted[p][positive] or 0.5) for p, _ in rows]
        metrics["roc_auc"] = float(roc_auc_score(y_true, scores))
    correct = {p: int(t == y) for (p, _), t, y in zip(rows, y_true, y_pred, strict=True)}
    return {"metrics": metrics, "correct": correct}
