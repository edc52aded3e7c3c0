"""The whole train-flow on the real Prefect engine and a real MLflow store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.train_flow import train_flow
from tasks.lineage import (
    DATASET_FINGERPRINT,
    FLOW_PARAMETERS,
    FLOW_RUN_ID,
    MANIFEST_SHA256,
    SPEC_HASH,
)
from training.config import InvalidParameters, TrainingSpec
from training.storage import tracking_uri

pytestmark = pytest.mark.slow
SMALL = {"epochs": 2, "image_size": 12, "batch_size": 50}


def test_full_flow_on_digits(prefect_engine, session_home):
    result = train_flow(dataset={"source": "builtin:digits"}, training=SMALL,
                        registry={"model_name": "flow-digits"})
    client = MlflowClient(tracking_uri())
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    # What "auto" starts on this machine: the GPUs, or 2 processes on a CPU machine.
    assert run.data.params["world_size"] == str(TrainingSpec().resolved_num_processes())
    for name in ("train_loss", "train_accuracy", "val_loss", "val_accuracy",
                 "images_per_second", "epoch_seconds"):
        history = client.get_metric_history(run.info.run_id, name)
        assert [m.step for m in history] == [1, 2], name
    assert run.data.metrics["test_accuracy"] > 0.5
    assert {"test_loss", "test_macro_f1"} <= set(run.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")}
    assert {"evaluation/training_curves.png", "evaluation/confusion_matrix.png",
            "evaluation/worst_predictions.png"} <= artifacts
    # One launch: the training's ranks evaluated; no second launch wrote rank progress here.
    assert result.trained.test_dir == result.evaluation.output_dir
    assert result.evaluation.metrics["accuracy"] == run.data.metrics["test_accuracy"]
    assert not (result.evaluation.output_dir / "progress").exists()
    # What a user looks for on the run page: datasets, system metrics, description, spec.
    contexts = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
    assert contexts.keys() == {"train", "val", "test"}
    assert {d.digest for d in contexts.values()} == {
        run.data.tags[MANIFEST_SHA256][:10]}
    assert contexts["test"].name == "builtin:digits test"
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics)
    assert "# train-flow result" in run.data.tags["mlflow.note.content"]
    # The data audit, on by default: its findings beside the run, its counts as metrics.
    assert "**Data audit** audit of 1797 images" in run.data.tags["mlflow.note.content"]
    assert {a.path for a in client.list_artifacts(run.info.run_id, "audit")} == {
        "audit/audit.json"}
    (session_home / "audit-download").mkdir(exist_ok=True)
    audit = json.loads(Path(client.download_artifacts(
        run.info.run_id, "audit/audit.json", str(session_home / "audit-download"))).read_text())
    assert run.data.metrics["audit_label_issues"] == sum(
        f["kind"] == "label_issue" for f in audit["findings"])
    assert run.data.metrics["audit_leaks"] == 0 and audit["images"] == 1797
    assert json.loads(run.data.tags[FLOW_PARAMETERS])["training"]["epochs"] == SMALL["epochs"]
    reg = result.registration
    version = client.get_model_version("flow-digits", reg.version)
    assert "champion" in version.aliases and reg.promoted
    for tag in (FLOW_RUN_ID, DATASET_FINGERPRINT):
        assert version.tags[tag] == run.data.tags[tag]

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:
        report = prefect.read_latest_artifacts()
    markdown = next(a.data for a in report if a.key == "train-flow-report")
    assert f"v{reg.version}" in markdown and "promoted" in markdown
    assert f"{run.data.metrics['test_accuracy']:.4f}" in markdown

    # Unchanged data and spec: the scheduled retrain skips; force=True trains and gates.
    skipped = train_flow(dataset={"source": "builtin:digits"}, training=SMALL,
                         registry={"model_name": "flow-digits"})
    assert skipped.skipped and skipped.mlflow_run_id is None
    forced = train_flow(dataset={"source": "builtin:digits"}, training=SMALL,
                        registry={"model_name": "flow-digits"}, force=True)
    assert forced.registration.version == str(int(reg.version) + 1)
    assert "challenger" in forced.registration.aliases

    # Reproduce version 1 from what was recorded on it.
    from commands.rerun import recorded

    params, _ = recorded("flow-digits", reg.version)
    assert params["training"]["epochs"] == SMALL["epochs"]
    assert "num_processes" not in params["training"]  # launch-only: not replayed
    again = train_flow(**params, force=True)
    redo = client.get_model_version("flow-digits", again.registration.version)
    assert redo.tags[SPEC_HASH] == version.tags[SPEC_HASH]
    assert redo.tags[MANIFEST_SHA256] == version.tags[MANIFEST_SHA256]


@pytest.mark.timeout(120)  # a hang guard: MLflow's own retries would take minutes
def test_unreachable_mlflow_fails_in_seconds(prefect_engine, monkeypatch):
    from training.processes import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(Exception, match="MLflow tracking store .* is not reachable"):
        train_flow(dataset={"source": "builtin:digits"}, training=SMALL)


def test_bad_parameters_fail_before_any_work(prefect_engine, tmp_path):
    with pytest.raises(InvalidParameters) as error:
        train_flow(dataset={"source": "builtin:digits"},
                   training={"model": "resnet-18", "epochs": 0})
    # One line per problem, naming the field, the value and a valid example; not retried.
    assert error.value.problems == [
        'training.model: unknown model \'resnet-18\'; use "basicnet", "resnet18", "vgg16" or '
        "another name from torchvision.models.list_models(), \"timm:<name>\" from timm's "
        "catalogue, or your own network as "
        '"<module>:<callable>", e.g. "mypkg.nets:build"',
        "training.epochs: Input should be greater than or equal to 1 (got 0)"]
    assert "\n" not in str(error.value) and "errors.pydantic.dev" not in str(error.value)
    with pytest.raises(Exception, match="does not exist"):
        train_flow(dataset={"source": str(tmp_path / "nowhere")})
