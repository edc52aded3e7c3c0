"""Lineage and retrain-skip: what a flow run records on its MLflow run and model version.

One naming style for every tag of ours, on runs and versions alike: `trainflow.<name>`.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from prefect import task
from prefect.runtime import flow_run

from tasks import run_logger
from training.config import LAUNCH_ONLY, DatasetSpec, RegistrySpec, SplitSpec, TrainingSpec
from training.data.sources import DatasetRef
from training.handoff import SplitResult
from training.storage import tracking_uri

CHAMPION, CHALLENGER = "champion", "challenger"

FLOW_RUN_ID = "trainflow.flow_run_id"
FLOW_RUN_NAME = "trainflow.flow_run_name"
FLOW_RUN_URL = "trainflow.flow_run_url"
GIT_COMMIT = "trainflow.git_commit"
GIT_DIRTY = "trainflow.git_dirty"
"""true when the code that ran had uncommitted changes: `trainflow rerun` then refuses"""
DATASET_SOURCE = "trainflow.dataset.source"
DATASET_FINGERPRINT = "trainflow.dataset.fingerprint"
MANIFEST_SHA256 = "trainflow.manifest_sha256"
SPEC_HASH = "trainflow.spec_hash"
FLOW_PARAMETERS = "trainflow.flow_parameters"
"""The flow's parameter models as validated, as one JSON object: enough to rerun."""


def metric_tag(name: str) -> str:
    """The tag on a version holding its test-split metric `name` (e.g. accuracy)."""
    return f"trainflow.test_{name}"


REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO, timeout=5,
                          check=True).stdout.strip()


def git_commit() -> str:
    try:
        return _git("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def git_dirty() -> bool:
    """Tracked product files changed since the commit: the commit alone does not reproduce it."""
    try:
        return bool(_git("status", "--porcelain", "--untracked-files=no", "--", "training",
                         "tasks", "flows", "commands", "pyproject.toml", "requirements.lock"))
    except (OSError, subprocess.SubprocessError):
        return True


def spec_hash(training: TrainingSpec, split: SplitSpec) -> str:
    """What makes two trainings the same, for skipping a retrain on unchanged inputs.

    The batch size is per process, so the world size (processes x machines) counts: changing
    it changes the effective batch and the model.
    """
    text = training.model_dump_json(exclude=LAUNCH_ONLY)
    world = training.resolved_num_processes() * training.num_machines
    return hashlib.sha256(f"{text}|{split.model_dump_json()}|world={world}".encode()
                          ).hexdigest()[:16]


def lineage_tags(dataset: DatasetSpec, split: SplitSpec, training: TrainingSpec,
                 registry: RegistrySpec, ref: DatasetRef, split_result: SplitResult) -> dict:
    """Where a model came from, tagged on the flow's MLflow run and on its model version."""
    tags = {
        FLOW_RUN_ID: str(flow_run.get_id()),
        FLOW_RUN_NAME: str(flow_run.get_name()),
        GIT_COMMIT: git_commit(),
        GIT_DIRTY: str(git_dirty()).lower(),
        DATASET_SOURCE: dataset.source,
        DATASET_FINGERPRINT: ref.fingerprint,
        MANIFEST_SHA256: split_result.manifest_sha256,
        SPEC_HASH: spec_hash(training, split),
        FLOW_PARAMETERS: json.dumps({"dataset": dataset.model_dump(), "split": split.model_dump(),
                                     "training": training.model_dump(),
                                     "registry": registry.model_dump(),
                                     "audit": (split_result.audit.policy if split_result.audit
                                               else {"enabled": False})}),
    }
    # Without PREFECT_UI_URL (a temporary server) Prefect builds "None/flow-runs/...".
    if (url := flow_run.get_flow_run_ui_url()) and url.startswith("http"):
        tags[FLOW_RUN_URL] = url
    return tags


def champion_version(client: MlflowClient, name: str):
    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None


@task
def find_unchanged_champion(model_name: str, lineage: dict[str, str]) -> str | None:
    """The champion version when it was trained on this very data and spec, else None."""
    champion = champion_version(MlflowClient(tracking_uri()), model_name)
    if champion is None:
        return None
    same = all(champion.tags.get(key) == lineage[key] for key in (DATASET_FINGERPRINT, SPEC_HASH))
    if same:
        run_logger().info(
            "skipping training: %s@%s (v%s) was trained on the same dataset fingerprint %s and "
            "training spec; pass force=true to retrain anyway", model_name, CHAMPION,
            champion.version, lineage[DATASET_FINGERPRINT][:12])
    return str(champion.version) if same else None
