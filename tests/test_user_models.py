"""Models users already have: their own network as `<module>:<callable>`, and weights from a
file (`training.weights`), trained, registered and served where their code is not installed."""

from __future__ import annotations

import base64
import json
import logging
import subprocess
import sys
import sysconfig
import textwrap

import mlflow
import pandas as pd
import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import save_file

from tasks.evaluate import evaluate_model
from tasks.lineage import FLOW_RUN_ID
from tasks.preflight import PreflightError, check_training
from tasks.register import register_model
from tasks.train import run_training
from tests.user_code import install_package
from training.config import RegistrySpec, TrainingSpec
from training.data.split import read_manifest
from training.handoff import TrainJob
from training.models.build import model_for

NETS = textwrap.dedent("""
    from torch import nn

    def small(num_classes):
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                             nn.Flatten(), nn.Linear(8 * 16, 32), nn.ReLU(),
                             nn.Linear(32, num_classes))

    def not_a_module(num_classes):
        return {"layers": num_classes}
""")


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    """A package `teamnets` that only this test's path can import (the ranks inherit it)."""
    return install_package(tmp_path / "code", monkeypatch, "teamnets", {"convs": NETS})


@pytest.mark.parametrize(("model", "needle"), [
    ("nosuchpkg.nets:build", "cannot import module 'nosuchpkg.nets'"),
    ("teamnets.convs:missing", "module teamnets.convs has no callable 'missing'"),
    ("teamnets.convs:not_a_module", "teamnets.convs.not_a_module(num_classes=2) returned dict, "
                                    "not a torch.nn.Module"),
])
def test_a_user_model_that_cannot_be_built_is_refused_before_any_work(user_code, model, needle):
    with pytest.raises(PreflightError, match="training.model") as error:
        check_training(TrainingSpec(model=model, num_processes=1), gpus=[])
    assert needle in str(error.value)


def test_a_model_name_must_be_a_catalogue_name_or_module_and_callable():
    with pytest.raises(ValueError, match='"<module>:<callable>"'):
        TrainingSpec(model="teamnets/convs.py:small")


def test_weights_from_a_file_load_with_a_new_head_for_other_classes(digits_split, user_code,
                                                                     tmp_path):
    _, split = digits_split
    job = TrainJob(split=split, output_dir=tmp_path / "a",
                   training={"model": "teamnets.convs:small", "image_size": 12})
    source = model_for(job)
    # Weights of the same network trained for 4 classes: the body loads, the head is new.
    donor = {k: v for k, v in source.state_dict().items()}
    donor["6.weight"], donor["6.bias"] = torch.randn(4, 32), torch.randn(4)
    save_file(donor, tmp_path / "donor.safetensors")
    job = job.model_copy(update={"training": job.training.model_copy(
        update={"weights": str(tmp_path / "donor.safetensors")})})
    loaded = model_for(job)
    assert torch.equal(loaded.state_dict()["0.weight"], donor["0.weight"])
    assert loaded.state_dict()["6.weight"].shape == (10, 32)
    # A state dict saved by torch.save loads too, without unpickling code.
    torch.save({"state_dict": donor}, tmp_path / "donor.pt")
    job = job.model_copy(update={"training": job.training.model_copy(
        update={"weights": str(tmp_path / "donor.pt")})})
    assert torch.equal(model_for(job).state_dict()["0.weight"], donor["0.weight"])


def test_weights_of_another_network_are_refused_naming_the_layers(digits_split, user_code,
                                                                  tmp_path):
    _, split = digits_split
    save_file({"conv1.weight": torch.zeros(32, 1, 3, 3)}, tmp_path / "other.safetensors")
    job = TrainJob(split=split, output_dir=tmp_path / "a",
                   training={"model": "teamnets.convs:small", "image_size": 12,
                             "weights": str(tmp_path / "other.safetensors")})
    with pytest.raises(ValueError, match="do not fit teamnets.convs:small") as error:
        model_for(job)
    assert "conv1.weight" in str(error.value)


LOAD_WITHOUT_THE_CODE = r"""
import base64, json, sys, importlib.util
sys.path.append(sys.argv[1])  # the environment's packages only: no project, no teamnets
assert importlib.util.find_spec("teamnets") is None
import mlflow, pandas as pd
model = mlflow.pyfunc.load_model(sys.argv[2])
out = model.predict(pd.DataFrame({"image": [base64.b64decode(b) for b in json.load(sys.stdin)]}))
leaked = [n for n in ("training", "tasks", "flows") if importlib.util.find_spec(n)]
print(json.dumps({"labels": list(out["label"]), "leaked": leaked}))
"""


def trained_and_registered(split, tmp_path, training: dict, name: str):
    """2 epochs on 2 processes, evaluated and registered in a fresh MLflow store: (the store's
    URI, the run, the registration)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = TrainJob(split=split, output_dir=tmp_path / "train",
                   training={"epochs": 2, "num_processes": 2, **training})
    trained = run_training(job, logging.getLogger("t"))
    assert trained.world_size == 2 and trained.best_metrics.val_accuracy > 0.2  # chance 0.1
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        experiment = MlflowClient(uri).create_experiment(
            name, artifact_location=(tmp_path / "a").as_uri())
        run_id = MlflowClient(uri).create_run(experiment).info.run_id
        evaluation = evaluate_model.fn(trained, run_id)
        registration = register_model.fn(trained, evaluation, RegistrySpec(model_name=name),
                                         run_id, {FLOW_RUN_ID: name})
    return uri, run_id, registration


@pytest.mark.slow
def test_a_user_model_trains_registers_and_serves_without_its_code_installed(
        digits_split, user_code, tmp_path):
    _, split = digits_split
    uri, run_id, registration = trained_and_registered(
        split, tmp_path, {"model": "teamnets.convs:small", "image_size": 12}, "team")
    client = MlflowClient(uri)
    assert registration.promoted
    files = {a.path for a in client.list_artifacts(run_id, "model/code")}
    assert files == {"model/code/trainflow_serving", "model/code/teamnets"}
    tests = [p for p, _, s in read_manifest(split.manifest) if s == "test"][:4]
    images = [base64.b64encode((split.root / p).read_bytes()).decode() for p in tests]
    done = subprocess.run(
        [sys.executable, "-S", "-c", LOAD_WITHOUT_THE_CODE, sysconfig.get_paths()["purelib"],
         "models:/team@champion"], input=json.dumps(images), capture_output=True, text=True,
        cwd=tmp_path, timeout=300,
        env={"MLFLOW_TRACKING_URI": uri, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    served = json.loads(done.stdout.strip().splitlines()[-1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        here = mlflow.pyfunc.load_model("models:/team@champion").predict(pd.DataFrame(
            {"image": [(split.root / p).read_bytes() for p in tests]}))
    assert served["leaked"] == [] and served["labels"] == list(here["label"])


def _hub_cache(tmp_path, monkeypatch, files: dict[str, dict[str, torch.Tensor]]):
    """A Hugging Face cache as the hub library writes it: refs/main names a snapshot."""
    import huggingface_hub.constants

    for repo, state in files.items():
        folder = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text("0" * 40)
        (folder / "snapshots" / ("0" * 40)).mkdir(parents=True)
        save_file(state, folder / "snapshots" / ("0" * 40) / "model.safetensors")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def test_timm_models_build_by_name_and_take_published_weights_from_the_hub_cache(
        tmp_path, monkeypatch):
    import timm

    from training.models.build import build_model

    _hub_cache(tmp_path, monkeypatch, {})
    spec = TrainingSpec(model="timm:resnet10t", pretrained=True, num_processes=1)
    with pytest.raises(PreflightError, match="not in the Hugging Face cache"
                                             r" \(timm/resnet10t.c3_in1k\).*training.weights"):
        check_training(spec, gpus=[])
    with pytest.raises(PreflightError, match="timm has no model 'resnet10x'"):
        check_training(TrainingSpec(model="timm:resnet10x", num_processes=1), gpus=[])
    published = timm.create_model("resnet10t").state_dict()  # 1,000 ImageNet classes
    monkeypatch.undo()
    _hub_cache(tmp_path / "second", monkeypatch, {"timm/resnet10t.c3_in1k": published})
    check_training(spec, gpus=[])
    model = build_model("timm:resnet10t", num_classes=3, channels=3, image_size=32,
                        pretrained=True)
    mine = model.state_dict()
    assert torch.equal(mine["conv1.0.weight"], published["conv1.0.weight"])
    assert mine["fc.weight"].shape == (3, 512)  # a new head for this task's classes
    # Inputs are normalised with the statistics the published weights were trained with.
    from training.models.build import normalization

    assert normalization("timm:inception_v3", True, 3) == ([0.5] * 3, [0.5] * 3)
    assert normalization("timm:resnet10t", True, 3)[0] == [0.485, 0.456, 0.406]


@pytest.mark.slow
def test_a_timm_model_trains_and_its_champion_requires_the_timm_that_trained_it(
        digits_split, tmp_path):
    import importlib.metadata

    _, split = digits_split
    uri, run_id, _ = trained_and_registered(
        split, tmp_path, {"model": "timm:resnet10t", "image_size": 16, "lr": 3e-3}, "timmnet")
    client = MlflowClient(uri)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        local = mlflow.artifacts.download_artifacts("models:/timmnet@champion",
                                                    dst_path=str(tmp_path / "m"))
        served = mlflow.pyfunc.load_model(local).predict(pd.DataFrame(
            {"image": [(split.root / p).read_bytes() for p, _, s in
                       read_manifest(split.manifest) if s == "test"][:8]}))
    # The exact versions that trained it, so a serving host installs the same.
    required = (tmp_path / "m" / "requirements.txt").read_text().split()
    for package in ("timm", "torch", "torchvision", "mlflow"):
        assert f"{package}=={importlib.metadata.version(package)}" in required, required
    assert {a.path for a in client.list_artifacts(run_id, "model/code")} == {
        "model/code/trainflow_serving"}  # timm is a requirement, not shipped code
    assert served["error"].isna().all() and served["label"].notna().all()
