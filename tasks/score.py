"""Batch scoring tasks: find the model and the images, score them under `accelerate launch`."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from prefect import task
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel

from runtime.launcher import launch
from runtime.progress_display import LaunchProgress
from tasks import run_logger
from tasks.data import credentials_from_secret_block
from tasks.tracking import experiment_id, experiment_name, fluent_mlflow
from trainflow_serving.images import IMAGE_EXTENSIONS
from training.config import DatasetSpec, TrainingSpec
from training.data.sources import fetch
from training.engine.events import ScoringFinished, last_from_rank_0
from training.evaluation.drift import Drift
from training.evaluation.shadow import Shadow
from training.storage import home, redacted, tracking_uri, write_text_atomic

KAGGLE_TEST_FOLDERS = ("test", "test1")  # where competitions keep their unlabelled images
DOGS_VS_CATS = ("dogs-vs-cats-redux-kernels-edition", "dogs-vs-cats")


class ScoringError(ValueError):
    """Bad scoring input; the message names the problem and the fix."""


class ScoringModel(BaseModel):
    uri: str
    name: str
    version: str
    run_id: str | None = None
    """the MLflow run that logged the version (its drift reference is there)"""
    local_path: Path
    class_names: list[str]


class Images(BaseModel):
    source: str
    root: Path
    paths: list[Path]


class Scores(BaseModel):
    predictions: Path
    submission: Path | None = None
    images: int
    errors: int
    images_per_second: float
    world_size: int
    mlflow_run_id: str | None = None
    statistics: Path | None = None
    """drift statistics of the batch's images, or of a sample (statistics.csv), when the
    drift check is on"""
    drift: Drift | None = None
    shadow: Shadow | None = None


@task
def resolve_model(model_name: str, alias: str, folder: Path) -> ScoringModel:
    """Find `models:/NAME@ALIAS`, check it is one of ours, and download it once."""
    client = MlflowClient(tracking_uri())
    try:
        version = client.get_model_version_by_alias(model_name, alias)
    except MlflowException:
        try:
            known = sorted(client.get_registered_model(model_name).aliases)
        except MlflowException:
            raise ScoringError(f"no registered model {model_name!r} in {redacted(tracking_uri())}; train "
                               "one with train-flow or give model_name of an existing one"
                               ) from None
        raise ScoringError(f"model {model_name!r} has no alias {alias!r}; its aliases: "
                           f"{', '.join(known) or 'none'}") from None
    uri = f"models:/{model_name}@{alias}"
    with fluent_mlflow(tracking_uri()):  # models:/ URIs read the global tracking URI
        metadata = mlflow.models.get_model_info(uri).metadata or {}
    if "class_names" not in metadata or "preprocessing" not in metadata:
        raise ScoringError(f"{uri} (v{version.version}) has no class names or preprocessing in "
                           "its metadata: it was not logged by this pipeline; register it again "
                           "with train-flow")
    local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(folder),
                                                     tracking_uri=tracking_uri()))
    return ScoringModel(uri=uri, name=model_name, version=str(version.version),
                        run_id=version.run_id, local_path=local,
                        class_names=metadata["class_names"])


@task(retries=2, retry_delay_seconds=5)
def find_images(images: str, subdir: str | None = None) -> Images:
    """The image files of a folder, of a Kaggle competition's unlabelled test set, or of a
    built-in dataset."""
    if not images.startswith(("builtin:", "kaggle:")) and not Path(images).expanduser().is_dir():
        raise ScoringError(f"images {images!r} is not a folder; give a folder of images, "
                           '"kaggle:competitions/<slug>" or "builtin:digits"')
    spec = DatasetSpec(source=images)
    root = fetch(spec, home(), credentials_from_secret_block() if spec.kind == "kaggle" else None)
    if spec.kind == "kaggle" and subdir is None:
        subdir = next((d for d in KAGGLE_TEST_FOLDERS if (root / d).is_dir()), None)
    root = root / subdir if subdir else root
    paths = sorted(p for p in root.rglob("*")
                   if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    if not paths:
        raise ScoringError(f"no image files ({', '.join(sorted(IMAGE_EXTENSIONS))}) under {root}")
    run_logger().info("%d images to score under %s", len(paths), root)
    return Images(source=images, root=root, paths=paths)


class Scored(BaseModel):
    predictions: Path
    """predictions.csv, its paths relative to the scored root"""
    images: int
    errors: int
    world_size: int
    seconds: float
    statistics: Path | None = None
    """statistics.csv (path, one column per drift statistic), when asked for"""


def score_files(model_dir: Path, paths: list[Path], root: Path, out: Path, spec: TrainingSpec,
                logger, one_process: bool = False, extra_env: dict[str, str] | None = None,
                statistics: int = 0) -> Scored:
    """Score every file exactly once with a downloaded model, under `accelerate launch` with
    `spec`'s launch fields (every GPU of this machine): predict-flow and the gate alike.
    `one_process`: in one plain process instead, for a few images. `extra_env`: for the
    scoring's processes (OMP_NUM_THREADS beside a training, say). `statistics`: the drift
    statistics (training/evaluation/drift.py) of about that many images, in statistics.csv."""
    listing = out / "images.txt"
    write_text_atomic(listing, "".join(f"{p}\n" for p in paths))
    started = time.perf_counter()
    progress = LaunchProgress(logger)
    try:
        events = launch(spec.on_this_machine(), "training.score",
                        ["--model", str(model_dir), "--images", str(listing), "--out", str(out)]
                        + ["--statistics", str(statistics)] * bool(statistics),
                        out, logger, on_event=progress.on_event, extra_env=extra_env,
                        one_process=one_process)
    finally:
        progress.close()
    seconds = time.perf_counter() - started
    done = last_from_rank_0(events, ScoringFinished)
    if done is None or done.scored is None:
        raise RuntimeError("scoring exited cleanly but rank 0 reported no predictions")
    scored = done.scored
    if scored["images"] != len(paths):
        raise RuntimeError(f"scored {scored['images']} images of {len(paths)}")
    measured = out / "statistics.csv"
    return Scored(predictions=_relative_paths(Path(scored["predictions"]), root),
                  images=scored["images"], errors=scored["errors"],
                  world_size=done.world_size, seconds=seconds,
                  statistics=_relative_paths(measured, root) if statistics else None)


@task(retries=1, retry_delay_seconds=2)
def score_images(model: ScoringModel, images: Images, out: Path,
                 num_processes: int | str = "auto", statistics: int = 0) -> Scores:
    """Every image scored exactly once, by every process (GPU) of this machine; `statistics`:
    with the drift statistics of about that many of them."""
    spec = TrainingSpec(num_processes=num_processes)  # only its launch fields are used
    scored = score_files(model.local_path, images.paths, images.root, out, spec, run_logger(),
                         statistics=statistics)
    submission = None
    if any(slug in images.source for slug in DOGS_VS_CATS) and "dog" in model.class_names:
        submission = kaggle_submission(scored.predictions, out / "submission.csv")
    return Scores(predictions=scored.predictions, submission=submission, images=scored.images,
                  errors=scored.errors, images_per_second=scored.images / scored.seconds,
                  world_size=scored.world_size, statistics=scored.statistics)


def _relative_paths(predictions: Path, root: Path) -> Path:
    """Paths in predictions.csv relative to the scored folder: readable and portable."""
    with open(predictions, newline="") as f:
        rows = list(csv.reader(f))
    for row in rows[1:]:
        row[0] = str(Path(row[0]).relative_to(root))
    with open(predictions, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)
    return predictions


def kaggle_submission(predictions: Path, path: Path) -> Path:
    """dogs-vs-cats-redux's format: id (the file's number), label (the probability of dog)."""
    with open(predictions, newline="") as f:
        rows = [(Path(r["path"]).stem, r["probability_dog"]) for r in csv.DictReader(f)]
    rows.sort(key=lambda r: (not r[0].isdigit(), int(r[0]) if r[0].isdigit() else r[0]))
    write_text_atomic(path, "id,label\n" + "".join(f"{i},{p or 0.5}\n" for i, p in rows))
    return path


@task
def publish_scores(model: ScoringModel, images: Images, scores: Scores) -> Scores:
    """The predictions in an MLflow run of the predict-flow experiment and a Prefect table."""
    client = MlflowClient(tracking_uri())
    experiment = experiment_id(client, experiment_name("predict"))
    run = client.create_run(experiment, tags={"trainflow.model_uri": model.uri,
                                                 "trainflow.model_version": model.version,
                                                 "trainflow.images": images.source})
    client.log_batch(run.info.run_id, metrics=[
        mlflow.entities.Metric(k, float(v), int(time.time() * 1000), 0)
        for k, v in {"images": scores.images, "errors": scores.errors,
                     "images_per_second": scores.images_per_second}.items()])
    client.log_artifact(run.info.run_id, str(scores.predictions))
    if scores.submission:
        client.log_artifact(run.info.run_id, str(scores.submission))
    client.set_terminated(run.info.run_id)
    with open(scores.predictions, newline="") as f:
        table = [row for _, row in zip(range(200), csv.DictReader(f), strict=False)]
    create_table_artifact(table=table, key="predict-flow-predictions",
                          description=f"{scores.images} images scored by {model.uri} "
                          f"(v{model.version}); first {len(table)} rows, all in MLflow")
    run_logger().info("scored %d images (%d unreadable) at %.0f images/s: %s", scores.images,
                      scores.errors, scores.images_per_second, json.dumps(
                          {"predictions": str(scores.predictions),
                           "submission": str(scores.submission)}))
    return scores.model_copy(update={"mlflow_run_id": run.info.run_id})
