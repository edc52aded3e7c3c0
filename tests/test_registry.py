"""Registration and the champion/challenger gate on real MLflow stores, then the predict command."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tasks.evaluate import evaluate_model
from tasks.gate import score_champion_early
from tasks.lineage import DATASET_FINGERPRINT, FLOW_RUN_ID, MANIFEST_SHA256, metric_tag
from tasks.register import CHAMPION_VALUE, COMPARED_WITH, PROMOTION, decided_at, register_model
from tasks.train import run_training
from training.config import RegistrySpec
from training.data.split import read_manifest
from training.handoff import TrainJob

# The gate holds a Prefect global concurrency slot per model name: a real Prefect API.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_engine")]
NAME = "digits-test"


@pytest.fixture(scope="module")
def models(digits_split, tmp_path_factory):
    """Three real trainings of clearly different quality."""
    _, split = digits_split
    folder = tmp_path_factory.mktemp("models")
    settings = {"good": {"epochs": 1, "lr": 1e-3}, "worse": {"epochs": 1, "lr": 1e-6},
                "better": {"epochs": 6, "lr": 2e-3}}
    trained = {}
    for name, extra in settings.items():
        job = TrainJob(split=split, output_dir=folder / name / "train",
                       training={"image_size": 12, "num_processes": 1, "batch_size": 32, **extra})
        trained[name] = run_training(job, logging.getLogger("t"))
    return split, trained


def _register(models, which, client, registry=None, flow_run_id=None):
    split, trained = models
    result = trained[which]
    run_id = client.create_run(client.create_experiment(f"e-{which}-{flow_run_id}")
                               ).info.run_id
    evaluation = evaluate_model.fn(result, run_id)
    lineage = {FLOW_RUN_ID: flow_run_id or f"flow-{which}", DATASET_FINGERPRINT: "fp",
               MANIFEST_SHA256: split.manifest_sha256}
    reg = register_model.fn(result, evaluation, registry or RegistrySpec(model_name=NAME), run_id,
                            lineage)
    return evaluation, reg


def _gate_story(models, client):
    good_eval, first = _register(models, "good", client)
    assert (first.version, first.promoted, first.reason) == ("1", True, "no champion yet")
    assert set(first.aliases) == {"champion", "challenger"}

    worse_eval, second = _register(models, "worse", client)
    assert worse_eval.metrics["accuracy"] < good_eval.metrics["accuracy"]
    assert second.promoted is False and "does not beat champion v1" in second.reason
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"
    assert str(client.get_model_version_by_alias(NAME, "challenger").version) == "2"

    better_eval, third = _register(models, "better", client)
    assert better_eval.metrics["accuracy"] > good_eval.metrics["accuracy"]
    # v1 scored again by the served model on the same test images: its evaluation's figure
    # (a near-tie may flip under another thread count: one image at most).
    assert third.promoted is True and third.champion_version == "1"
    assert third.compared_images == good_eval.images
    assert abs(third.champion_value - good_eval.metrics["accuracy"]) <= 1 / good_eval.images
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "3"
    tags = client.get_model_version(NAME, "3").tags
    assert tags[PROMOTION] == "promoted"
    assert float(tags[metric_tag("accuracy")]) == better_eval.metrics["accuracy"]
    assert float(tags[CHAMPION_VALUE]) == third.champion_value
    assert client.get_model_version(NAME, "3").description.startswith(
        f"v3: test_accuracy {better_eval.metrics['accuracy']:.4f} vs champion v1 "
        f"{third.champion_value:.4f} on the same {good_eval.images} test images (McNemar p=")
    assert tags[FLOW_RUN_ID] == "flow-better" and tags[DATASET_FINGERPRINT] == "fp"
    assert client.get_model_version(NAME, "2").tags[PROMOTION] == "not promoted"

    # A retried task finds its version instead of registering another.
    again = _register(models, "better", client, flow_run_id="flow-better")[1]
    assert again.version == "3"
    # ...and keeps the decision made then: never judged against itself as champion.
    assert again.promoted and again.champion_version == "1" and "champion" in again.aliases
    assert client.get_model_version(NAME, "3").tags[PROMOTION] == "promoted"
    assert len(client.search_model_versions(f"name='{NAME}'")) == 3
    return better_eval


def test_gate_on_a_sqlite_store(models, tmp_path, monkeypatch):
    client = _sqlite_client(tmp_path, monkeypatch)
    better_eval = _gate_story(models, client)

    # The predict command on PNG files: the champion's labels are the evaluation's.
    split, _ = models
    # Clear-cut predictions only: other thread counts move the last digits of near-ties.
    expected = {p: pred for p, _, pred, prob, _ in _predictions(better_eval.predictions)
                if float(prob) > 0.5}
    rows = [r for r in read_manifest(split.manifest) if r[2] == "test" and r[0] in expected][:5]
    assert len(rows) == 5
    files = [str(split.root / p) for p, _, _ in rows]
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not an image")
    out = subprocess.run([str(Path(sys.executable).parent / "trainflow"), "predict", "--model",
                          NAME, *files, str(not_an_image)], capture_output=True, text=True,
                         timeout=120,
                         env={**_env(), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    assert out.returncode == 0, out.stderr[-2000:]
    *lines, bad = [line.split("\t") for line in out.stdout.strip().splitlines()]
    assert bad[:2] == [str(not_an_image), "error"] and "not an image file" in bad[2]
    assert [(path, label) for path, label, _ in lines] == [
        (f, expected[p]) for f, (p, _, _) in zip(files, rows, strict=True)]
    assert all(0 < float(prob) <= 1 for _, _, prob in lines)


def _sqlite_client(tmp_path, monkeypatch) -> MlflowClient:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # default artifact root ./mlruns lands in tmp_path
    return MlflowClient(uri)


def test_a_challenger_gets_a_review_beside_its_champion_and_a_model_card(
        models, digits_split, tmp_path, monkeypatch):
    """The review of v2 against champion v1 on the same test images, from the gate's own
    predictions: in the version's MLflow run, its description and a Prefect artifact."""
    import csv
    import json

    from prefect.client.orchestration import get_client

    from tasks.gate import champion_predictions
    from tasks.register import record
    from tasks.review import REVIEW_TAG, artifact_key, review_version

    client = _sqlite_client(tmp_path, monkeypatch)
    source, split = digits_split
    _register(models, "good", client)
    run_id = client.create_run(client.create_experiment("e-review")).info.run_id
    evaluation = evaluate_model.fn(models[1]["better"], run_id)
    lineage = {FLOW_RUN_ID: "flow-review", DATASET_FINGERPRINT: "fp",
               MANIFEST_SHA256: split.manifest_sha256}
    registration = register_model.fn(models[1]["better"], evaluation, RegistrySpec(
        model_name=NAME), run_id, lineage)
    assert registration.champion_version == "1"
    review = review_version.fn(source, split, models[1]["better"], evaluation, registration,
                               run_id, lineage)

    logged = {f.path for f in client.list_artifacts(run_id, "review")}
    assert logged == {f"review/{n}" for n in ("review.html", "review.json", "model_card.md",
                                              "reliability.png", "confusion.png")}
    figures = json.loads((review.folder / "review.json").read_text())
    assert [m["name"] for m in figures["models"]] == ["challenger v2", "champion v1"]
    assert figures["images"] == evaluation.images
    # The changed images, counted by hand from the two predictions files.
    with open(evaluation.predictions, newline="") as f:
        ours = {r["path"]: r["correct"] == "1" for r in csv.DictReader(f)}
        f.seek(0)
        labels = {r["path"]: r["label"] for r in csv.DictReader(f)}
    gate = champion_predictions(NAME, "1", split)  # the champion as the gate scored it
    with open(gate, newline="") as f:
        theirs = {r["path"]: r["label"] == labels[r["path"]] for r in csv.DictReader(f)}
    paths = list(ours)
    assert [paths[i] for i in figures["now_right"]] == [p for p in paths if ours[p] and not theirs[p]]
    assert [paths[i] for i in figures["now_wrong"]] == [p for p in paths if theirs[p] and not ours[p]]
    version = client.get_model_version(NAME, registration.version)
    assert version.description.startswith(registration.description())
    assert f"## Model card: {NAME} v{registration.version}" in version.description
    test_counts = split.counts["test"]
    assert f"| 3 | {split.counts['train']['3']} | {split.counts['val']['3']} | " \
           f"{test_counts['3']} |" in version.description
    assert version.tags[REVIEW_TAG] == review.url and review.url.endswith("review/review.html")
    # A later decision (a person's answer) rewrites the sentence and keeps the card.
    record(client, registration.model_copy(update={"reason": "approved by a person"}), "approved")
    after = client.get_model_version(NAME, registration.version).description
    assert "approved by a person" in after and "## Model card" in after
    with get_client(sync_client=True) as prefect:
        artifact = prefect.read_latest_artifacts()
    [mine] = [a for a in artifact if a.key == artifact_key(NAME, registration.version)]
    assert registration.description() in mine.data and review.url in mine.data


def test_promote_false_registers_without_promoting(models, tmp_path, monkeypatch):
    client = _sqlite_client(tmp_path, monkeypatch)
    _, reg = _register(models, "good", client, RegistrySpec(model_name=NAME, promote=False))
    assert reg.promoted is False and reg.aliases == ["challenger"]
    assert "promote=false" in reg.reason


def test_significance_check_records_mcnemar(models, tmp_path, monkeypatch):
    client = _sqlite_client(tmp_path, monkeypatch)
    _register(models, "good", client)
    strict = RegistrySpec(model_name=NAME, significance=1e-12)
    _, reg = _register(models, "better", client, strict)
    assert reg.p_value is not None and 0 < reg.p_value < 1
    assert reg.promoted is False and "not significant" in reg.reason
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"


def _predictions(path):
    import csv

    with open(path, newline="") as f:
        return [tuple(r.values()) for r in csv.DictReader(f)]


def _env():
    import os

    return dict(os.environ)


def test_a_chance_level_model_is_never_promoted(models, tmp_path, monkeypatch):
    """Scored like always answering the majority class: not promoted, even with no champion."""
    client = _sqlite_client(tmp_path, monkeypatch)
    split, trained = models
    run_id = client.create_run(client.create_experiment("chance")).info.run_id
    evaluation = evaluate_model.fn(trained["worse"], run_id)
    majority = max(c.support for c in evaluation.per_class.values()) / evaluation.images
    chance = evaluation.model_copy(update={"metrics": {**evaluation.metrics,
                                                       "accuracy": majority}})
    reg = register_model.fn(trained["worse"], chance, RegistrySpec(model_name=NAME), run_id,
                            {FLOW_RUN_ID: "flow-chance", DATASET_FINGERPRINT: "fp",
                             MANIFEST_SHA256: split.manifest_sha256})
    assert reg.promoted is False and reg.reason.startswith("no better than chance")
    assert "majority class" in reg.reason
    assert reg.aliases == ["challenger"]  # and no champion at all
    assert client.get_registered_model(NAME).aliases.keys() == {"challenger"}
    version = client.get_model_version(NAME, reg.version)
    assert version.description.startswith(
        f"v{reg.version}: test_accuracy {majority:.4f}: not promoted, no better than chance")


def test_a_noise_level_gain_leaves_the_champion_alone(models, tmp_path, monkeypatch):
    import csv

    client = _sqlite_client(tmp_path, monkeypatch)
    good_eval, first = _register(models, "good", client)
    assert first.promoted
    # The same model, right on two more test images: a gain well inside the noise.
    with open(good_eval.predictions, newline="") as f:
        rows = list(csv.DictReader(f))
    wrong = [r for r in rows if r["correct"] == "0"][:2]
    assert len(wrong) == 2
    for row in wrong:
        row["correct"] = "1"
    noisy = tmp_path / "noisy.csv"
    with open(noisy, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    accuracy = good_eval.metrics["accuracy"] + 2 / len(rows)
    challenger = good_eval.model_copy(update={"predictions": noisy, "metrics": {
        **good_eval.metrics, "accuracy": accuracy}})
    split, trained = models
    run_id = client.create_run(client.create_experiment("noisy")).info.run_id
    reg = register_model.fn(trained["good"], challenger, RegistrySpec(model_name=NAME), run_id,
                            {FLOW_RUN_ID: "flow-noisy", DATASET_FINGERPRINT: "fp",
                             MANIFEST_SHA256: split.manifest_sha256})
    assert reg.promoted is False and reg.value > good_eval.metrics["accuracy"]
    assert "not significant" in reg.reason and 0.05 <= reg.p_value < 1
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == first.version
    assert "it may be noise" in client.get_model_version(NAME, reg.version).description



def _register_result(client, result, flow_run_id, registry=None):
    run_id = client.create_run(client.create_experiment(f"e-{flow_run_id}")).info.run_id
    evaluation = evaluate_model.fn(result, run_id)
    lineage = {FLOW_RUN_ID: flow_run_id, DATASET_FINGERPRINT: "fp",
               MANIFEST_SHA256: result.job.split.manifest_sha256}
    return evaluation, register_model.fn(result, evaluation,
                                         registry or RegistrySpec(model_name=NAME), run_id, lineage)


def test_the_champion_is_scored_on_the_challengers_test_images(models, digits_split, session_home,
                                                                tmp_path, monkeypatch, caplog):
    """Another split (as after grown data): v1 is judged on v2's test images, not its own."""
    import mlflow
    import pandas as pd

    from training.config import SplitSpec
    from training.data.split import split_dataset

    client = _sqlite_client(tmp_path, monkeypatch)
    ref, _ = digits_split
    other = split_dataset(ref, SplitSpec(seed=7), session_home)
    job = TrainJob(split=other, output_dir=tmp_path / "other" / "train",
                   training={"image_size": 12, "num_processes": 1, "batch_size": 32, "epochs": 1})
    challenger = run_training(job, logging.getLogger("t"))
    _, first = _register(models, "good", client)

    # Never promoted (min_improvement 1), so every registration below faces v1.
    never = RegistrySpec(model_name=NAME, min_improvement=1.0)
    # train-flow scores the champion while the challenger trains; the gate then reuses that.
    # The store is the home's default, as on a hand-started run: no MLFLOW_TRACKING_URI, and
    # MLflow's own global URI elsewhere (the training thread sets and resets it meanwhile).
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(None)  # as the training thread's fluent_mlflow leaves it
    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # MLflow's default store is ./mlflow.db
    with caplog.at_level(logging.INFO, logger="trainflow"):
        assert score_champion_early.fn(other, job.training, never) == first.version
    # Beside the training's ranks, which hold every core, it takes one thread.
    tests = [(p, label) for p, label, s in read_manifest(other.manifest) if s == "test"]
    assert f"scoring {len(tests)} images: 1 process, 1 thread each" in caplog.text
    monkeypatch.chdir(tmp_path)
    [scored] = _gate_files(first.version)
    before = scored.stat().st_mtime_ns
    evaluation, second = _register_result(client, challenger, "flow-other-split", never)
    assert scored.stat().st_mtime_ns == before
    theirs = {p for p, _, s in read_manifest(models[0].manifest) if s == "test"}
    assert {p for p, _ in tests} != theirs  # a different exam
    assert second.champion_version == first.version and second.compared_images == len(tests)
    # The figure the gate used is v1's own accuracy on these images, through the served model.
    v1 = mlflow.pyfunc.load_model(f"models:/{NAME}/{first.version}")
    frame = v1.predict(pd.DataFrame({"image": [(other.root / p).read_bytes() for p, _ in tests]}))
    accuracy = sum(a == b for a, (_, b) in zip(frame["label"], tests, strict=True)) / len(tests)
    assert second.champion_value == pytest.approx(accuracy, abs=1 / len(tests))
    assert f"vs champion v1 {second.champion_value:.4f} on the same {len(tests)} test images" in (
        client.get_model_version(NAME, second.version).description)

    # The same champion and test set: its predictions are not scored again.
    _, third = _register_result(client, challenger, "flow-other-split-again", never)
    assert third.champion_value == second.champion_value
    assert _gate_files(first.version) == [scored] and scored.stat().st_mtime_ns == before


def _gate_files(version: str) -> list[Path]:
    """The gate's cached predictions of one champion version of NAME in this store."""
    import hashlib

    from training.storage import home, tracking_uri

    run_id = MlflowClient(tracking_uri()).get_model_version(NAME, version).run_id
    key = hashlib.sha256(f"{tracking_uri()}|{NAME}|{version}|{run_id}".encode()).hexdigest()[:16]
    return sorted((home() / "gate" / key).rglob("predictions.csv"))


@pytest.mark.extended
def test_a_champion_set_by_hand_holds_until_beaten(models, tmp_path, monkeypatch):
    """Roll back with `trainflow champion`: the next, weaker challenger leaves it in place."""
    import os

    from prefect.settings import PREFECT_API_URL

    client = _sqlite_client(tmp_path, monkeypatch)
    _register(models, "good", client)
    assert _register(models, "better", client)[1].promoted
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "2"
    out = subprocess.run([str(Path(sys.executable).parent / "trainflow"), "champion", NAME, "1",
                          "--reason", "v2 misreads sevens"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(),
                                           "MLFLOW_TRACKING_URI": client.tracking_uri})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "digits-test v1 is champion (was v2): v2 misreads sevens" in out.stdout
    v1 = client.get_model_version(NAME, "1")
    assert "champion" in v1.aliases and v1.tags[PROMOTION] == "set by hand"
    assert "v2 misreads sevens" in v1.description

    _, third = _register(models, "worse", client)
    assert third.promoted is False and third.champion_version == "1"
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"


@pytest.mark.extended
def test_decisions_released_together_each_face_the_real_champion(models, tmp_path, monkeypatch):
    """Two registrations of one model at the same instant, four times: replaying the decisions
    in the order they were made, each names the champion that was current then."""
    import threading

    client = _sqlite_client(tmp_path, monkeypatch)
    results = []
    for round_ in range(4):
        barrier = threading.Barrier(2)

        def register(which, flow_run_id, barrier=barrier):
            barrier.wait()
            results.append(_register(models, which, client, flow_run_id=flow_run_id)[1])

        pair = [threading.Thread(target=register, args=(which, f"r{round_}-{which}"))
                for which in (("good", "better") if round_ % 2 else ("worse", "good"))]
        [t.start() for t in pair]
        [t.join(300) for t in pair]
    assert len(results) == 8
    decided = sorted(client.search_model_versions(f"name='{NAME}'"),
                     key=lambda v: decided_at(v.tags))
    champion = None
    for v in decided:
        assert v.tags.get(COMPARED_WITH) == champion, (v.version, v.description)
        if v.tags[PROMOTION] == "promoted":
            champion = str(v.version)
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == champion


def test_the_gates_reason_says_which_rule_held_the_challenger_back():
    """A tie and a gain below min_improvement are told apart, in the fields a person sets."""
    from tasks.decision import decide
    from tasks.gate import SameImages

    champion = SameImages(version="1", images=100, metrics={"accuracy": 0.90}, correct={},
                          cached=True)
    chance = (True, "")
    tie = decide(RegistrySpec(), 0.90, champion, 1.0, chance)
    assert tie == (False, "does not beat champion v1 (0.9000)")
    small = decide(RegistrySpec(min_improvement=0.05), 0.92, champion, 0.01, chance)
    assert small == (False, "gain +0.0200 over v1 (0.9000) is below registry.min_improvement "
                            "0.05")
    assert decide(RegistrySpec(min_improvement=0.01), 0.92, champion, 0.01, chance) == (
        True, "beats champion v1 (0.9000)")


def test_the_decision_time_reads_as_iso_8601_and_older_unix_seconds_still_read():
    from datetime import UTC, datetime

    assert decided_at({"trainflow.decided_at": "2026-12-07T18:52:03.123456+00:00"}) == \
        datetime(2026, 12, 7, 18, 52, 3, 123456, tzinfo=UTC)
    assert decided_at({"trainflow.decided_at": "1796669523.5"}) == \
        datetime.fromtimestamp(1796669523.5, UTC)
