"""prepare_dataset and split_dataset: the data stages, over training/ code."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from prefect import task

from runtime.credentials import secret_block
from runtime.progress_display import PhaseProgress
from runtime.remote import (
    publish_dataset,
    publish_split,
    remote_root,
    restore_dataset,
    restore_split,
)
from tasks import RESUMABLE, run_logger
from training.config import AuditSpec, DatasetSpec, SplitSpec, TrainingSpec
from training.data.audit import Features
from training.data.kaggle import KaggleCredentials
from training.data.sides import split_sides
from training.data.sources import DatasetRef, prepare
from training.data.split import SplitResult
from training.data.split import split_dataset as make_split
from training.data.store import store_bytes
from training.storage import home


def credentials_from_secret_block() -> KaggleCredentials | None:
    """Kaggle credentials from the Prefect Secret block named by KAGGLE_SECRET_BLOCK, if set.

    The block holds {"username": ..., "key": ...} or {"token": ...}. The values stay in memory:
    they are never task parameters, so they never reach the Prefect database or the logs.
    """
    data = secret_block("KAGGLE_SECRET_BLOCK")
    if data is None:
        return None
    return KaggleCredentials(data.get("username"), data.get("key"), data.get("token"))


@task(retries=2, retry_delay_seconds=5, **RESUMABLE)
def prepare_dataset(dataset: DatasetSpec) -> DatasetRef:
    """Fetch (once) and list the labelled images of the dataset source."""
    logger = run_logger()
    ref = prepare(dataset, home(), credentials_from_secret_block(), warn=logger.warning)
    logger.info("dataset %s: %d images in %d classes at %s (fingerprint %s)", dataset.source,
                ref.image_count, len(ref.class_names), ref.root, ref.fingerprint[:12])
    if (remote := remote_root()) is not None and (key := publish_dataset(remote, ref)):
        logger.info("dataset version in %s: %s", remote, key)
    return ref


def starting_features(training: TrainingSpec, audit: AuditSpec) -> Features | None:
    """A fine-tune's backbone as the audit's label check features, when `audit.labels_from`
    says so; None for thumbnails."""
    if audit.labels_from != "backbone":
        return None
    if not training.starts_from_weights:
        run_logger().warning(
            "audit.labels_from=backbone, but %s starts from scratch: no backbone to read yet, "
            "so the label check reads thumbnails (set training.pretrained or training.weights, "
            "or audit.labels_from=thumbnails)", training.model)
        return None

    def features(root: Path, paths: list[str]) -> np.ndarray:
        from training.models.features import backbone_features

        return backbone_features(training, root, paths)

    return f"{training.model}'s starting backbone", features


@task(**RESUMABLE)
def split_dataset(dataset: DatasetRef, split: SplitSpec, training: TrainingSpec,
                  audit: AuditSpec = AuditSpec()  # noqa: B008  (frozen: a safe default)
                  ) -> SplitResult:
    """Check and audit every image and write the stratified, stable train/val/test manifest.

    The check is also the training's decode: each image is decoded once, at the side its
    split is trained or evaluated at, and the training launch decodes nothing. The audit
    (training/data/audit.py) keeps duplicates on one side of the split; with
    `audit.labels_from: backbone` a fine-tune's label check reads its starting backbone.
    """
    logger = run_logger()
    sides = split_sides(training)
    with decode_progress(logger) as on_progress:
        result = make_split(dataset, split, home(), sides, on_progress, audit,
                            starting_features(training, audit))
    if result.audit is not None:
        logger.info("%s: see %s", result.audit.summary, result.audit.file)
        if result.audit.label_issue_share > audit.max_label_issue_share:
            logger.warning("%.1f%% of the images look mislabelled (over "
                           "audit.max_label_issue_share=%s): check the label_issue rows of %s "
                           "before trusting the test figures", 100 * result.audit.label_issue_share,
                           audit.max_label_issue_share, result.audit.file)
    logger.info("manifest %s: %s", result.manifest,
                {name: sum(c.values()) for name, c in result.counts.items()})
    folder = result.manifest.parent.parent
    logger.info("decoded images: %.1f MB in %s", store_bytes(folder) / 1e6, folder / "decoded")
    if result.quarantined:
        logger.warning("%d unreadable images quarantined: see %s", result.quarantined,
                       result.manifest.parent / "quarantine.json")
    if (remote := remote_root()) is not None:
        published = publish_split(remote, result, (sides or {}).values())
        logger.info("split in %s: manifest %s, stores %s", remote,
                    published.manifest_sha256[:12], published.stores)
    return result


@task
def bring_data_here(dataset: DatasetRef, split: SplitResult) -> None:
    """With a remote root, a flow run retried on another machine finds the data stages done
    (their results are in the bucket) but not their files: fetch the dataset version and the
    split, at the same paths, before anything reads them. Not cached: it looks every time."""
    remote = remote_root()
    if remote is None:
        return
    logger = run_logger()
    if restore_dataset(remote, dataset):
        logger.info("dataset %s fetched from %s into %s", dataset.source, remote,
                    dataset.source_root)
    if restore_split(remote, split):
        logger.info("split %s fetched from %s into %s", split.manifest_sha256[:12], remote,
                    split.manifest.parent.parent)


@contextlib.contextmanager
def decode_progress(logger, every_s: float = 10.0) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on a terminal, else a log line every `every_s` (a heartbeat in the UI);
    the last count is always logged."""
    display = PhaseProgress(logger, every_s=every_s, unit="images")
    counted = [0, 0]

    def on_progress(done: int, total: int) -> None:
        counted[:] = done, total
        display.update("decoding images", done, total)

    try:
        yield on_progress
    finally:
        display.close()
        if counted[1]:
            logger.info("decoded %d of %d images", *counted)
