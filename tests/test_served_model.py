"""The registered model as a product: loads without this project, takes raw images, serves,
and scores folders in batch through predict-flow."""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys
import sysconfig
import urllib.request
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from mlflow import MlflowClient
from PIL import Image

from tests.servers import started
from tests.versions import register_trained
from training.data.split import read_manifest
from training.processes import free_port

pytestmark = pytest.mark.slow
NAME = "served-digits"


@pytest.fixture(scope="module")
def registered(digits_split, tmp_path_factory):
    """One real training, evaluated and registered as champion in a SQLite store."""
    _, split = digits_split
    folder = tmp_path_factory.mktemp("served")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    evaluation, registration, _ = register_trained(split, folder, uri, "served", NAME,
                                                   {"epochs": 2}, "served")
    assert registration.promoted
    # Only clear-cut predictions are compared: a different thread count can move the last
    # float digits, which may flip a near-tie but never a label above 0.5.
    predicted = {row["path"]: row["predicted"] for row in _csv(evaluation.predictions)
                 if float(row["probability"]) > 0.5}
    assert len(predicted) > evaluation.images / 2
    tests = [(p, label) for p, label, s in read_manifest(split.manifest) if s == "test"]
    return {"uri": uri, "folder": folder, "split": split, "predicted": predicted, "tests": tests}


def _csv(path):
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _jpeg(path) -> bytes:
    buffer = io.BytesIO()
    Image.open(path).convert("RGB").save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


NO_PROJECT = r"""
import base64, json, sys
sys.path.append(sys.argv[1])  # the environment's packages only: no .pth, no editable project
for name in ("training", "tasks", "flows"):
    try:
        __import__(name)
    except ImportError:
        continue
    raise SystemExit(f"the project is importable here ({name}): the test would prove nothing")
import mlflow, pandas as pd
model = mlflow.pyfunc.load_model(sys.argv[2])
request = json.loads(sys.stdin.read())
images = [base64.b64decode(b) for b in request["bytes"]] + request["base64"] + ["bm90IGFuIGltYWdl"]
out = model.predict(pd.DataFrame({"image": images}))
# Only the serving package came with the model: nothing named like the project's packages.
import importlib.util
leaked = [n for n in ("training", "tasks", "flows", "commands") if importlib.util.find_spec(n)]
print(json.dumps({"leaked": leaked, "serving": sys.modules["trainflow_serving"].__file__}))
print(out.to_json(orient="records"))
"""


def test_the_champion_loads_and_predicts_where_the_project_is_absent(registered, tmp_path):
    split = registered["split"]
    rows = [t for t in registered["tests"] if t[0] in registered["predicted"]][:6]
    raw = [(split.root / p).read_bytes() for p, _ in rows]
    request = {"bytes": [base64.b64encode(b).decode() for b in raw[:3]],
               "base64": [base64.b64encode(b).decode() for b in raw[3:]]}
    site = sysconfig.get_paths()["purelib"]
    # -S: no site module, so neither .pth files nor the editable install of this project;
    # run from an empty folder, so the checkout is not on the path either.
    done = subprocess.run([sys.executable, "-S", "-c", NO_PROJECT, site, f"models:/{NAME}@champion"],
                          input=json.dumps(request), capture_output=True, text=True,
                          cwd=tmp_path, timeout=300,
                          env={"MLFLOW_TRACKING_URI": registered["uri"], "PATH": "/usr/bin:/bin",
                               "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    *_, loaded, predicted = done.stdout.strip().splitlines()
    loaded, out = json.loads(loaded), json.loads(predicted)
    assert loaded["leaked"] == []
    assert "/code/trainflow_serving/" in loaded["serving"]  # the model's copy, not a checkout
    assert [r["label"] for r in out[:6]] == [registered["predicted"][p] for p, _ in rows]
    classes = [str(d) for d in range(10)]
    for r in out[:6]:
        assert r["error"] is None
        assert r["probability"] == pytest.approx(max(r[f"probability_{c}"] for c in classes))
        assert sum(r[f"probability_{c}"] for c in classes) == pytest.approx(1, abs=1e-5)
    assert out[6]["label"] is None and "image" in out[6]["error"]  # the corrupt row, alone


def test_the_model_describes_its_input_and_output(registered, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registered["uri"])
    info = mlflow.models.get_model_info(f"models:/{NAME}@champion")
    assert info.flavors.keys() >= {"python_function"} and "pytorch" not in info.flavors
    assert [c["name"] for c in info.signature.inputs.to_dict()] == ["image"]
    assert info.signature.inputs.to_dict()[0]["type"] == "binary"
    outputs = [c["name"] for c in info.signature.outputs.to_dict()]
    assert outputs[:2] == ["label", "probability"] and "probability_7" in outputs
    assert info.metadata["class_names"] == [str(d) for d in range(10)]
    assert info.metadata["preprocessing"]["image_size"] == 12
    files = {a.path for a in MlflowClient(registered["uri"]).list_artifacts(info.run_id, "model")}
    assert "model/MLmodel" in files and not any(f.endswith(".pkl") for f in files)


def test_mlflow_serves_the_champion_for_a_base64_jpeg(registered, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registered["uri"])
    split = registered["split"]
    jpegs = [_jpeg(split.root / p) for p, _ in registered["tests"][:3]]
    local = mlflow.pyfunc.load_model(f"models:/{NAME}@champion")
    expected = list(local.predict(pd.DataFrame({"image": jpegs}))["label"])
    port = free_port()
    command = [str(sys.executable.rsplit("/", 1)[0] + "/mlflow"), "models", "serve", "-m",
               f"models:/{NAME}@champion", "--env-manager", "local", "-h", "127.0.0.1",
               "-p", str(port)]
    with started(command, f"http://127.0.0.1:{port}/ping", tmp_path / "serve.log",
                 env={"MLFLOW_TRACKING_URI": registered["uri"]}, timeout=180):
        body = {"dataframe_split": {"columns": ["image"],
                                    "data": [[base64.b64encode(j).decode()] for j in jpegs]}}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())["predictions"]
    assert [row["label"] for row in answer] == expected
    assert all(0 < row["probability"] <= 1 for row in answer)


def test_predict_flow_scores_each_image_once_across_two_processes(
        registered, prefect_engine, tmp_path, monkeypatch):
    from flows.predict_flow import predict_flow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", registered["uri"])
    split = registered["split"]
    folder = tmp_path / "incoming"
    (folder / "sub").mkdir(parents=True)
    names = []
    clear = [t for t in registered["tests"] if t[0] in registered["predicted"]]
    for i, (path, _) in enumerate(clear[:21]):
        name = f"sub/{i:02d}.png" if i % 2 else f"{i:02d}.png"
        (folder / name).write_bytes((split.root / path).read_bytes())
        names.append((name, path))
    (folder / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    scores = predict_flow(images=str(folder), model_name=NAME, num_processes=2)
    assert scores.world_size == 2 and scores.images == 22 and scores.errors == 1
    rows = {r["path"]: r for r in _csv(scores.predictions)}
    assert sorted(rows) == sorted([n for n, _ in names] + ["broken.jpg"])  # each exactly once
    assert all(rows[n]["label"] == registered["predicted"][p] for n, p in names)
    assert rows["broken.jpg"]["error"] and not rows["broken.jpg"]["label"]
    client = MlflowClient(registered["uri"])
    assert {a.path for a in client.list_artifacts(scores.mlflow_run_id)} == {"predictions.csv"}
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_latest_artifacts()
    table = next(a for a in artifacts if a.key == "predict-flow-predictions")
    assert "broken.jpg" in json.dumps(table.data)


def test_scoring_warns_of_versions_other_than_the_models(registered, tmp_path):
    """A scoring process names each pinned requirement this environment does not match, as
    MLflow's own check would (it is skipped: it costs about 2 s per process)."""
    model = Path(mlflow.artifacts.download_artifacts(
        artifact_uri=MlflowClient(registered["uri"]).get_model_version_download_uri(NAME, "1"),
        dst_path=str(tmp_path / "model"), tracking_uri=registered["uri"]))
    split = registered["split"]
    path, _ = next(t for t in registered["tests"] if t[0] in registered["predicted"])
    (tmp_path / "images.txt").write_text(f"{split.root / path}\n")

    def score(out: str) -> str:
        done = subprocess.run([sys.executable, "-m", "training.score", "--model", str(model),
                               "--images", str(tmp_path / "images.txt"), "--out",
                               str(tmp_path / out)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert (tmp_path / out / "predictions.csv").is_file()
        return done.stdout + done.stderr

    assert "warning: the model was logged with" not in score("same")
    requirements = model / "requirements.txt"
    requirements.write_text(requirements.read_text().replace(
        f"torch=={torch_version()}", "torch==1.0.0") + "\nno-such-package-here==1.0\n")
    mlmodel = model / "MLmodel"
    mlmodel.write_text(re.sub(r"python_version: \S+", "python_version: 3.8.10", mlmodel.read_text()))
    said = score("other")
    assert f"warning: the model was logged with torch==1.0.0 (installed: {torch_version()})" in said
    assert "warning: the model was logged with no-such-package-here==1.0 (not installed)" in said
    assert "warning: the model was logged with Python 3.8.10 (running: " in said


def torch_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("torch").split("+")[0]


def test_bad_scoring_input_is_refused_before_any_launch(registered, prefect_engine, tmp_path,
                                                        monkeypatch):
    from flows.predict_flow import predict_flow
    from tasks.score import ScoringError

    monkeypatch.setenv("MLFLOW_TRACKING_URI", registered["uri"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ScoringError, match="no image files"):
        predict_flow(images=str(tmp_path / "empty"), model_name=NAME)
    with pytest.raises(ScoringError, match="no registered model 'nope'"):
        predict_flow(images=str(tmp_path / "empty"), model_name="nope")
    with pytest.raises(ScoringError, match="has no alias 'gold'; its aliases: challenger, champion"):
        predict_flow(images=str(tmp_path / "empty"), model_name=NAME, alias="gold")
    # A model somebody registered by hand, without the metadata scoring needs.
    client = MlflowClient(registered["uri"])
    mlflow.set_tracking_uri(registered["uri"])
    with mlflow.start_run(experiment_id=client.get_experiment_by_name("served").experiment_id):
        info = mlflow.pyfunc.log_model(name="m", python_model=_Constant())
    version = mlflow.register_model(info.model_uri, "bare-model")
    client.set_registered_model_alias("bare-model", "champion", version.version)
    with pytest.raises(ScoringError, match="no class names or preprocessing"):
        predict_flow(images=str(tmp_path / "empty"), model_name="bare-model")
    assert not list((tmp_path / "empty").iterdir())


class _Constant(mlflow.pyfunc.PythonModel):
    def predict(self, context, model_input, params=None):
        return model_input


def test_kaggle_test_set_is_found_and_a_submission_written(tmp_path, home, monkeypatch):
    from tasks.score import find_images, kaggle_submission
    from tests.imagegen import photo
    from tests.kaggle_standin import KaggleStandIn

    monkeypatch.setenv("KAGGLE_API_ENVIRONMENT", "TEST")
    monkeypatch.setenv("KAGGLE_USERNAME", "tester")
    monkeypatch.setenv("KAGGLE_KEY", "k")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    slug = "dogs-vs-cats-redux-kernels-edition"
    with KaggleStandIn("tester", "k") as server:
        server.archives[f"competitions/{slug}"] = _archive_with_test_set(photo, 5)
        found = find_images.fn(f"kaggle:competitions/{slug}")
    assert [p.name for p in found.paths] == [f"{i}.jpg" for i in (1, 10, 2, 3, 4)]
    predictions = tmp_path / "predictions.csv"
    predictions.write_text("path,label,probability,probability_cat,probability_dog,error\n"
                           "10.jpg,dog,0.9,0.1,0.9,\n2.jpg,cat,0.8,0.8,0.2,\n1.jpg,,,,,bad\n")
    text = kaggle_submission(predictions, tmp_path / "submission.csv").read_text()
    assert text == "id,label\n1,0.5\n2,0.2\n10,0.9\n"


def _archive_with_test_set(photo, n: int) -> bytes:
    import zipfile

    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        for i in range(1, n + 1):
            buf = io.BytesIO()
            photo("cat", i, 24).save(buf, "JPEG")
            zf.writestr(f"test/{10 if i == 5 else i}.jpg", buf.getvalue())
    outer = io.BytesIO()
    with zipfile.ZipFile(outer, "w") as zf:
        zf.writestr("test.zip", inner.getvalue())
    return outer.getvalue()
