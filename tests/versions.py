"""A real training of the digits, evaluated and registered in an MLflow store, for the tests
that need registered versions without a flow run."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tasks.decision import Registration
from tasks.evaluate import Evaluation, evaluate_model
from tasks.lineage import FLOW_RUN_ID
from tasks.register import register_model
from tasks.train import run_training
from training.config import RegistrySpec
from training.handoff import SplitResult, TrainJob


def register_trained(split: SplitResult, folder: Path, uri: str, experiment: str,
                     model_name: str, training: dict, flow_run_id: str, promote: bool = True
                     ) -> tuple[Evaluation, Registration, str]:
    """Train on `split` in one process, evaluate, register: (evaluation, registration, the
    MLflow run id)."""
    job = TrainJob(split=split, output_dir=folder / f"train-{flow_run_id}",
                   training={"image_size": 12, "num_processes": 1, "batch_size": 32, **training})
    trained = run_training(job, logging.getLogger("t"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        client = MlflowClient(uri)
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(
            experiment, artifact_location=(folder / "art").as_uri())
        run_id = client.create_run(experiment_id).info.run_id
        evaluation = evaluate_model.fn(trained, run_id)
        registration = register_model.fn(
            trained, evaluation, RegistrySpec(model_name=model_name, promote=promote), run_id,
            {FLOW_RUN_ID: flow_run_id})
    return evaluation, registration, run_id
