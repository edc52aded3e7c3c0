"""The one MLflow run per flow run: opened first, closed last with the flow's outcome."""

from __future__ import annotations

import subprocess
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from prefect import task
from prefect.runtime import flow_run

from training.storage import home, tracking_uri

EXPERIMENT = "train-flow"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1], timeout=5,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def experiment_id(client: MlflowClient) -> str:
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is not None:
        return experiment.experiment_id
    uri = client.tracking_uri
    # A local SQLite store would otherwise put artifacts in ./mlruns of whatever the cwd is.
    location = None if uri.startswith(("http", "databricks")) else (home() / "mlartifacts").as_uri()
    try:
        return client.create_experiment(EXPERIMENT, artifact_location=location)
    except mlflow.exceptions.MlflowException:  # created concurrently by another flow run
        return client.get_experiment_by_name(EXPERIMENT).experiment_id


def flow_run_url() -> str | None:
    ui = flow_run.get_flow_run_ui_url()
    return ui or None


@task
def open_mlflow_run(dataset_fingerprint: str, source: str) -> str:
    """Create the flow's MLflow run, tagged with its Prefect flow run and the data version."""
    client = MlflowClient(tracking_uri())
    tags = {
        "prefect.flow_run_id": str(flow_run.get_id()),
        "prefect.flow_run_name": str(flow_run.get_name()),
        "mlflow.source.git.commit": git_commit(),
        "dataset.fingerprint": dataset_fingerprint,
        "dataset.source": source,
    }
    if url := flow_run_url():
        tags["prefect.flow_run_url"] = url
    run = client.create_run(experiment_id(client), tags=tags,
                            run_name=f"train-flow/{flow_run.get_name()}")
    return run.info.run_id


@task
def close_mlflow_run(run_id: str, status: str) -> None:
    """FINISHED, FAILED or KILLED: a run is never left RUNNING."""
    MlflowClient(tracking_uri()).set_terminated(run_id, status=status)


def run_url(run_id: str) -> str:
    uri = tracking_uri()
    client = MlflowClient(uri)
    exp = client.get_run(run_id).info.experiment_id
    base = uri if uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base.rstrip('/')}/#/experiments/{exp}/runs/{run_id}"
