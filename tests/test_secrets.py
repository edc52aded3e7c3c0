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
