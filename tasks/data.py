"""prepare_dataset and split_dataset: the data stages, over training/ code."""

from __future__ import annotations

import json
import os

from prefect import task

from tasks import run_logger
from training.config import DatasetSpec, SplitSpec
from training.data.kaggle import KaggleCredentials
from training.data.sources import DatasetRef, prepare
from training.data.split import SplitResult
from training.data.split import split_dataset as make_split
from training.storage import home


def credentials_from_secret_block() -> KaggleCredentials | None:
    """Kaggle credentials from the Prefect Secret block named by KAGGLE_SECRET_BLOCK, if set.

    The block holds {"username": ..., "key": ...} or {"token": ...}. The values stay in memory:
    they are never task parameters, so they never reach the Prefect database or the logs.
    """
    name = os.environ.get("KAGGLE_SECRET_BLOCK")
    if not name:
        return None
    from prefect.blocks.system import Secret

    value = Secret.load(name).get()
    data = json.loads(value) if isinstance(value, str) else value
    return KaggleCredentials(data.get("username"), data.get("key"), data.get("token"))


@task(retries=2, retry_delay_seconds=5)
def prepare_dataset(dataset: DatasetSpec) -> DatasetRef:
    """Fetch (once) and list the labelled images of the dataset source."""
    logger = run_logger()
    ref = prepare(dataset, home(), credentials_from_secret_block())
    logger.info("dataset %s: %d images in %d classes at %s (fingerprint %s)", dataset.source,
                ref.image_count, len(ref.class_names), ref.root, ref.fingerprint[:12])
    return ref


@task
def split_dataset(dataset: DatasetRef, split: SplitSpec) -> SplitResult:
    """Check every image and write the stratified, stable train/val/test manifest."""
    logger = run_logger()
    result = make_split(dataset, split, home())
    logger.info("manifest %s: %s", result.manifest,
                {name: sum(c.values()) for name, c in result.counts.items()})
    if result.quarantined:
        logger.warning("%d unreadable images quarantined: see %s", result.quarantined,
                       result.manifest.parent / "quarantine.json")
    return result
