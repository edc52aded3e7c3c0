"""What predict-flow tells about a batch: drift from the champion's test split, and how the
newest challenger would have labelled it (shadow scoring).

Two real trainings on the digits, registered in a SQLite MLflow store (v1 champion, v2 a
challenger left unpromoted), each with the drift reference the flows record; predict-flow runs
on the real Prefect engine and its events are read back from the server.
"""

from __future__ import annotations

import csv
import time

import httpx
import mlflow
import pandas as pd
import pytest
from mlflow import MlflowClient
from PIL import Image, ImageFilter, ImageOps

from commands.champion import describe_versions
from tasks.drift import EVENT, record_drift_reference
from tasks.shadow import SHADOW_RECORD
from tests.versions import register_trained
from training.data.split import read_manifest
from training.evaluation.drift import STATISTICS

pytestmark = pytest.mark.slow
NAME = "watched-digits"


@pytest.fixture(scope="module")
def versions(digits_split, tmp_path_factory):
    _, split = digits_split
    folder = tmp_path_factory.mktemp("drift")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    for epochs, promote in ((3, True), (1, False)):
        evaluation, _, run_id = register_trained(
            split, folder, uri, "drift", NAME, {"epochs": epochs, "lr": 0.003},
            f"drift-{epochs}", promote)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MLFLOW_TRACKING_URI", uri)
            record_drift_reference.fn(split, evaluation, run_id)
    client = MlflowClient(uri)
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"
    assert str(client.get_model_version_by_alias(NAME, "challenger").version) == "2"
    val = [path for path, _, side in read_manifest(split.manifest) if side == "val"]
    return {"uri": uri, "root": split.root, "val": val}


def _copies(versions, folder, change=None, n=None):
    """The val images (never trained on, never in the reference) as new files."""
    folder.mkdir(parents=True)
    for i, path in enumerate(versions["val"][:n]):
        image = Image.open(versions["root"] / path).convert("L")
        (change(image) if change else image).save(folder / f"{i:04d}.png")
    return folder


def drift_events(api: str) -> list[dict]:
    found = httpx.post(f"{api}/events/filter",
                       json={"filter": {"event": {"name": [EVENT]}}, "limit": 50}).json()
    return found["events"]


def wait_for_events(api: str, count: int, timeout: float = 60) -> list[dict]:
    """The drift events on the server, once `count` are there (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while len(events := drift_events(api)) < count and time.monotonic() < deadline:
        time.sleep(0.5)
    return events


def test_a_batch_like_the_test_set_passes_and_inverted_or_blurred_copies_drift(
        versions, prefect_engine, tmp_path, monkeypatch):
    from prefect.settings import PREFECT_API_URL

    from flows.predict_flow import predict_flow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", versions["uri"])
    api = PREFECT_API_URL.value()
    client = MlflowClient(versions["uri"])
    like = predict_flow(images=str(_copies(versions, tmp_path / "like")), model_name=NAME,
                        num_processes=1, drift={"statistics_images": 100})
    assert like.drift is not None and not like.drift.drifted, like.drift
    # The statistics of a sample spread over the batch (every 2nd of 179), the rest of all.
    assert like.drift.batch_images == 179
    assert len(pd.read_csv(like.statistics)) == 90
    assert {t.name for t in like.drift.tests} == {"classes", "confidence", *STATISTICS}
    recorded = client.get_run(like.mlflow_run_id).data.metrics
    assert recorded["drift"] == 0 and "drift_brightness_p_value" in recorded

    changes = {"inverted": ImageOps.invert,
               "blurred": lambda image: image.resize((32, 32)).filter(
                   ImageFilter.GaussianBlur(4))}
    for number, (name, change) in enumerate(changes.items(), start=1):
        scores = predict_flow(images=str(_copies(versions, tmp_path / name, change)),
                              model_name=NAME, num_processes=1)
        assert scores.drift.drifted, (name, scores.drift)
        metrics = client.get_run(scores.mlflow_run_id).data.metrics
        assert metrics["drift"] == 1
        drifted = set(scores.drift.drifted_tests)
        assert drifted & {"brightness", "sharpness", "contrast"}, (name, scores.drift)
        assert all(metrics[f"drift_{t}_effect"] >= 0.1 for t in drifted)
        # One event per drifted batch, none for the batch like the test set (its event, if
        # any, was sent first by the same process).
        events = wait_for_events(api, number)
        assert len(events) == number, events
        newest = max(events, key=lambda e: e["occurred"])
        assert newest["resource"]["trainflow.model"] == NAME
        assert newest["resource"]["trainflow.model_version"] == "1"
        assert newest["payload"]["mlflow_run_id"] == scores.mlflow_run_id
        assert set(newest["payload"]["drifted"]) == drifted


def test_shadow_scoring_writes_the_champions_predictions_and_counts_agreement(
        versions, prefect_engine, tmp_path, monkeypatch):
    from flows.predict_flow import predict_flow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", versions["uri"])
    folder = tmp_path / "batch"
    folder.mkdir()
    for i, path in enumerate(sorted(versions["root"].rglob("*.png"))[::9]):
        (folder / f"{i:03d}.png").write_bytes(path.read_bytes())
    assert len(list(folder.iterdir())) == 200

    scores = predict_flow(images=str(folder), model_name=NAME, num_processes=1,
                          shadow="challenger", drift={"check": False})

    # Each scoring is each model's own: both versions loaded as a user would, on the same 200
    # files. Only clear-cut answers are compared: another thread count can move the last float
    # digits, which may flip a near-tie, never a label above 0.6.
    frame = pd.DataFrame({"image": [p.read_bytes() for p in sorted(folder.iterdir())]})

    def scored(path) -> list[dict]:
        with open(path, newline="") as f:
            return sorted(csv.DictReader(f), key=lambda r: r["path"])

    written = scored(scores.predictions)  # only the champion's predictions are written
    theirs = scored(scores.shadow.differences.with_name("predictions.csv"))
    for version, rows in (("1", written), ("2", theirs)):
        by_hand = mlflow.pyfunc.load_model(f"models:/{NAME}/{version}").predict(frame)
        clear = [(r["label"], h.label) for r, h in zip(rows, by_hand.itertuples(), strict=True)
                 if h.probability > 0.6]
        assert len(clear) > 100 and all(a == b for a, b in clear), version
    # The hand count, from the two scorings' files.
    champion = [r["label"] for r in written]
    challenger = [r["label"] for r in theirs]
    agreeing = sum(a == b for a, b in zip(champion, challenger, strict=True))
    shadow = scores.shadow
    assert (shadow.champion, shadow.challenger) == ("1", "2")
    assert shadow.overall.images == 200 and shadow.overall.agreeing == agreeing
    for label, figures in shadow.per_class.items():
        mine = [i for i, c in enumerate(champion) if c == label]
        assert figures.images == len(mine)
        assert figures.agreeing == sum(challenger[i] == label for i in mine)
    with open(shadow.differences, newline="") as f:
        assert len(list(csv.DictReader(f))) == 200 - agreeing

    client = MlflowClient(versions["uri"])
    run = client.get_run(scores.mlflow_run_id)
    assert run.data.metrics["shadow_agreement"] == pytest.approx(agreeing / 200)
    assert {a.path for a in client.list_artifacts(scores.mlflow_run_id, "shadow")} == {
        "shadow/shadow.json", "shadow/differences.csv"}
    assert SHADOW_RECORD in client.get_model_version(NAME, "2").tags
    listing = describe_versions(NAME)
    assert f"v2: shadowed champion v1 on 1 batch, 200 images, agreed on {agreeing}" in listing
