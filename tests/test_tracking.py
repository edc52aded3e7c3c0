"""One rule for our MLflow experiments: names from configuration, one artifact root rule."""

from __future__ import annotations

from mlflow import MlflowClient

from tasks.tracking import experiment_id, experiment_name


def test_experiment_names_and_artifact_root_come_from_configuration(tmp_path, monkeypatch, home):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert experiment_name() == "train-flow" and experiment_name("predict") == "predict-flow"
    default = client.get_experiment(experiment_id(client))
    assert default.name == "train-flow"
    assert default.artifact_location == (home / "mlartifacts").as_uri()  # never ./mlruns

    monkeypatch.setenv("TRAINFLOW_EXPERIMENT", "team-retrains")
    monkeypatch.setenv("TRAINFLOW_ARTIFACT_ROOT", (tmp_path / "bucket").as_uri())
    team = client.get_experiment(experiment_id(client))
    assert team.name == "team-retrains"
    assert team.artifact_location == (tmp_path / "bucket").as_uri()
    assert experiment_id(client) == team.experiment_id  # found again, not created twice
