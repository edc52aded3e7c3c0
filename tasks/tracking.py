"""The one MLflow run per flow run: opened first, closed last with the flow's outcome."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import mlflow
from mlflow import MlflowClient
from mlflow.data.sources import LocalArtifactDatasetSource
from mlflow.entities import Dataset, DatasetInput, InputTag
from prefect import task
from prefect.runtime import flow_run

from tasks import MLFLOW_RETRIES, RESUMABLE, run_logger
from tasks.lineage import DATASET_SOURCE, GIT_COMMIT
from training.data.split import SPLITS, read_manifest
from training.handoff import SplitResult
from training.storage import home, tracking_uri

DATASET_CONTEXT = "mlflow.data.context"
"""The input tag `mlflow.log_input(dataset, context=...)` sets, which the UI shows per dataset."""


def experiment_name(kind: str = "train") -> str:
    """The MLflow experiment of train-flow and sweep-flow runs ("train") or of predict-flow
    runs ("predict"): TRAINFLOW_EXPERIMENT / TRAINFLOW_PREDICT_EXPERIMENT, else today's names."""
    if kind == "predict":
        return os.environ.get("TRAINFLOW_PREDICT_EXPERIMENT", "predict-flow")
    return os.environ.get("TRAINFLOW_EXPERIMENT", "train-flow")


def artifact_location(tracking: str) -> str | None:
    """Where a new experiment keeps its artifacts, one rule for every experiment of ours.

    TRAINFLOW_ARTIFACT_ROOT when set (e.g. s3://bucket/mlflow, for a team whose tracking URI
    is its database); an MLflow server's own root (it proxies artifacts); else the home's
    mlartifacts folder, not ./mlruns of whatever the working folder is.
    """
    if root := os.environ.get("TRAINFLOW_ARTIFACT_ROOT"):
        return root
    if tracking.startswith(("http", "databricks")):
        return None
    return (home() / "mlartifacts").as_uri()


def experiment_id(client: MlflowClient, name: str | None = None) -> str:
    """The experiment's id, created on first use (concurrent creators agree)."""
    name = name or experiment_name()
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location(
            client.tracking_uri))
    except mlflow.exceptions.MlflowException:  # created concurrently by another flow run
        return client.get_experiment_by_name(name).experiment_id


@contextlib.contextmanager
def fluent_mlflow(uri: str | None) -> Iterator[None]:
    """MLflow's fluent API (start_run, register_model, ...) pointed at `uri` for a while.

    `mlflow.set_tracking_uri` also writes MLFLOW_TRACKING_URI into this process's environment,
    which every later run in the process and every subprocess would read: both are put back.
    """
    before = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)  # None: unset again


@task(**RESUMABLE, **MLFLOW_RETRIES)
def open_mlflow_run(lineage: dict[str, str], data: SplitResult, flow_name: str = "train-flow"
                    ) -> str:
    """Create the flow's MLflow run, tagged with its lineage (Prefect run, code, data), with
    the train/val/test splits as its MLflow datasets."""
    client = MlflowClient(tracking_uri())
    # MLflow's own tag too, so that the UI shows the commit in its usual place.
    tags = {**lineage, "mlflow.source.git.commit": lineage[GIT_COMMIT],
            "mlflow.source.name": f"flows/{flow_name.replace('-', '_')}.py",
            "mlflow.source.type": "JOB"}
    run = client.create_run(experiment_id(client), tags=tags,
                            run_name=f"{flow_name}/{flow_run.get_name()}")
    client.log_inputs(run.info.run_id, datasets=split_datasets(lineage[DATASET_SOURCE], data))
    if data.audit is not None and data.audit.file.is_file():
        # What the figures stand on, beside them: audit/audit.json and its counts as metrics.
        client.log_artifact(run.info.run_id, str(data.audit.file), "audit")
        for name, value in data.audit.counts.items():
            client.log_metric(run.info.run_id, name, value)
    return run.info.run_id


def split_datasets(source: str, data: SplitResult) -> list[DatasetInput]:
    """One MLflow dataset per split: its files and labels, digest = the manifest's hash."""
    import pandas as pd

    rows = read_manifest(data.manifest)
    inputs = []
    for split in SPLITS:
        frame = pd.DataFrame([(p, label) for p, label, s in rows if s == split],
                             columns=["path", "label"])
        dataset = mlflow.data.from_pandas(
            frame, source=LocalArtifactDatasetSource(data.root.as_uri()), targets="label",
            name=f"{source} {split}", digest=data.manifest_sha256[:10])
        inputs.append(DatasetInput(Dataset(**dataset.to_dict()),
                                   tags=[InputTag(DATASET_CONTEXT, split)]))
    return inputs


@task
def close_mlflow_run(run_id: str, status: str) -> None:
    """FINISHED, FAILED or KILLED: a run is never left RUNNING."""
    MlflowClient(tracking_uri()).set_terminated(run_id, status=status)


@contextlib.contextmanager
def failing_with_the_flow(run_id: str) -> Iterator[None]:
    """An exception (or a cancellation) inside ends the MLflow run FAILED (or KILLED).

    close_mlflow_run is called directly, not as a task: a cancelled flow run may not start
    new task runs, and the MLflow run must never be left RUNNING.
    """
    try:
        yield
    except BaseException as e:
        status = "FAILED" if isinstance(e, Exception) else "KILLED"
        try:
            close_mlflow_run.fn(run_id, status)
        except Exception as unreachable:  # MLflow down too: the flow's own error is the news
            run_logger().warning("could not mark MLflow run %s %s (%s); it stays RUNNING until "
                                 "closed by hand", run_id, status, type(unreachable).__name__)
        raise


def run_url(run_id: str) -> str:
    uri = tracking_uri()
    client = MlflowClient(uri)
    exp = client.get_run(run_id).info.experiment_id
    base = uri if uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base.rstrip('/')}/#/experiments/{exp}/runs/{run_id}"
