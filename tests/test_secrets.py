"""A planted Kaggle key must not appear in logs, parameters, MLflow or any file a run writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.imagegen import dogs_vs_cats_zip
from tests.kaggle_standin import KaggleStandIn

pytestmark = pytest.mark.slow
KEY = "KGLKEY-PLANTED-7f3a9c1e5b"
SLUG = "dogs-vs-cats-redux-kernels-edition"


def _files_containing(root: Path, needle: bytes) -> list[Path]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and needle in path.read_bytes():
            hits.append(path)
    return hits


def test_kaggle_key_never_leaks(prefect_engine, session_home, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, LogFilter, LogFilterFlowRunId

    from flows.train_flow import train_flow

    monkeypatch.setenv("KAGGLE_API_ENVIRONMENT", "TEST")
    monkeypatch.setenv("KAGGLE_USERNAME", "tester")
    monkeypatch.setenv("KAGGLE_KEY", KEY)
    with KaggleStandIn("tester", KEY) as kaggle:
        kaggle.archives[f"competitions/{SLUG}"] = dogs_vs_cats_zip({"cat": 30, "dog": 30})
        result = train_flow(
            dataset={"source": f"kaggle:competitions/{SLUG}", "labels": "filename",
                     "subdir": "train"},
            training={"epochs": 1, "image_size": 12, "batch_size": 16},
            registry={"model_name": "secret-test"})
    assert result.registration is not None and kaggle.downloads == 1

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter())
        run = next(r for r in runs if
                   "kaggle" in str(r.parameters.get("dataset")))
        assert KEY not in str(run.parameters)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
        task_runs = client.read_task_runs()
    assert logs, "the flow run logged nothing: the search below would prove nothing"
    assert not [log.message for log in logs if KEY in log.message]
    assert not [t.name for t in task_runs if KEY in str(t.task_inputs)]
    # The MLflow store (SQLite file + artifacts), run folders, job files and progress events.
    assert _files_containing(session_home, KEY.encode()) == []
    assert _files_containing(Path(os.environ["PREFECT_HOME"]), KEY.encode()) == []


def test_secret_blocks_fill_the_flow_process_and_never_the_ranks(prefect_engine, monkeypatch):
    from prefect.blocks.system import Secret

    from runtime.credentials import MissingSecretBlock, use_secret_blocks
    from runtime.launcher import launch_env

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_USERNAME",
                 "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    Secret(value={"access_key_id": "AKIATEST", "secret_access_key": "S3-PLANTED-91c"}).save(
        "s3-test", overwrite=True)
    monkeypatch.setenv("TRAINFLOW_S3_SECRET_BLOCK", "s3-test")
    assert use_secret_blocks() == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "S3-PLANTED-91c"
    # The training ranks' environment holds none of it.
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "MLFLOW-PLANTED-3d")
    ranks = launch_env()
    assert "S3-PLANTED-91c" not in ranks.values() and "MLFLOW-PLANTED-3d" not in ranks.values()

    Secret(value={"username": "u"}).save("mlflow-test", overwrite=True)
    monkeypatch.setenv("TRAINFLOW_MLFLOW_SECRET_BLOCK", "mlflow-test")
    with pytest.raises(MissingSecretBlock, match="lacks password"):
        use_secret_blocks()
    monkeypatch.setenv("TRAINFLOW_MLFLOW_SECRET_BLOCK", "no-such-block")
    with pytest.raises(MissingSecretBlock, match="does not exist"):
        use_secret_blocks()


def test_a_database_uri_shows_no_password():
    from training.storage import redacted

    assert redacted("postgresql+psycopg://team:s3cret@db:5432/mlflow") == \
        "postgresql+psycopg://team:***@db:5432/mlflow"
    assert redacted("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
