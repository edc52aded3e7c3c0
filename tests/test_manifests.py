"""Labelling tools' exports as datasets: each written as the tool writes it, read as it is;
the split column kept; a bad row named before anything is decoded."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.imagegen import photo
from training.config import DatasetSpec, SplitSpec
from training.data.labels import DatasetError
from training.data.sources import prepare
from training.data.split import read_manifest, split_dataset

PER_CLASS = 12


def images(folder: Path) -> list[tuple[str, str]]:
    """(path relative to `folder`, class): 12 cats and 12 dogs in images/."""
    (folder / "images").mkdir(parents=True)
    made = []
    for label in ("cat", "dog"):
        for i in range(PER_CLASS):
            name = f"images/{label}{i:02d}.jpg"
            photo(label, i, 32).save(folder / name)
            made.append((name, label))
    return made


def sides_of(rows: list[tuple[str, str]]) -> dict[str, str]:
    """train for most, val and test for the 9th and 10th, 11th and 12th of each class."""
    return {path: ("val" if path[-6:-4] in ("08", "09") else
                   "test" if path[-6:-4] in ("10", "11") else "train") for path, _ in rows}


def read(manifest: Path, home: Path):
    ref = prepare(DatasetSpec(source=str(manifest)), home)
    return ref, split_dataset(ref, SplitSpec(), home)


def classes_by_file(ref, split) -> dict[str, str]:
    return {Path(p).name.split("__")[-1]: label for p, label, _ in read_manifest(split.manifest)}


def expected(rows) -> dict[str, str]:
    return {Path(p).name: label for p, label in rows}


def test_a_csv_with_a_split_column_keeps_its_splits(tmp_path):
    rows = images(tmp_path)
    side = sides_of(rows)
    with open(tmp_path / "labels.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "label", "split"])
        writer.writerows((path, label, side[path]) for path, label in rows)
    ref, split = read(tmp_path / "labels.csv", tmp_path / "home")
    assert ref.class_names == ["cat", "dog"] and ref.image_count == 2 * PER_CLASS
    assert classes_by_file(ref, split) == expected(rows)
    assert {Path(p).name.split("__")[-1]: s for p, _, s in read_manifest(split.manifest)} == {
        Path(p).name: s for p, s in side.items()}
    assert split.given_splits == {"train": "train", "val": "val", "test": "test"}


def test_vertex_ai_import_csv_without_a_header(tmp_path):
    rows = images(tmp_path)
    side = {"train": "TRAINING", "val": "VALIDATION", "test": "TEST"}
    lines = [f"{side[s]},{path},{label}" for (path, label), s in
             zip(rows, sides_of(rows).values(), strict=True)]
    (tmp_path / "import.csv").write_text("\n".join(lines) + "\n")
    ref, split = read(tmp_path / "import.csv", tmp_path / "home")
    assert classes_by_file(ref, split) == expected(rows)
    assert split.counts["test"] == {"cat": 2, "dog": 2}


def test_hugging_face_metadata_jsonl(tmp_path):
    rows = images(tmp_path)
    (tmp_path / "metadata.jsonl").write_text("".join(
        json.dumps({"file_name": path, "species": label}) + "\n" for path, label in rows))
    ref, split = read(tmp_path / "metadata.jsonl", tmp_path / "home")
    assert classes_by_file(ref, split) == expected(rows)
    assert split.given_splits is None  # no split named: carved as a folder's


def test_sagemaker_ground_truth_output_manifest(tmp_path):
    rows = images(tmp_path)
    classes = ["cat", "dog"]
    lines = [json.dumps({"source-ref": path, "pets": classes.index(label), "pets-metadata": {
        "class-name": label, "confidence": 0.93, "type": "groundtruth/image-classification",
        "human-annotated": "yes", "job-name": "labeling-job/pets"}}) for path, label in rows]
    (tmp_path / "output.manifest.jsonl").write_text("\n".join(lines) + "\n")
    ref, split = read(tmp_path / "output.manifest.jsonl", tmp_path / "home")
    assert classes_by_file(ref, split) == expected(rows)


@pytest.mark.parametrize("export", ["json", "json-min"])
def test_label_studio_exports(tmp_path, export):
    rows = images(tmp_path)
    if export == "json":
        tasks = [{"id": i, "data": {"image": f"/data/local-files/?d={path}"},
                  "annotations": [{"id": i, "result": [{"from_name": "choice", "to_name": "image",
                                                        "type": "choices",
                                                        "value": {"choices": [label]}}]}]}
                 for i, (path, label) in enumerate(rows)]
    else:
        tasks = [{"image": f"/data/local-files/?d={path}", "id": i, "choice": label,
                  "annotator": 1} for i, (path, label) in enumerate(rows)]
    (tmp_path / "export.json").write_text(json.dumps(tasks))
    ref, split = read(tmp_path / "export.json", tmp_path / "home")
    assert classes_by_file(ref, split) == expected(rows)


def test_parquet(tmp_path):
    import pandas as pd

    rows = images(tmp_path)
    pd.DataFrame(rows, columns=["image", "label"]).to_parquet(tmp_path / "labels.parquet")
    ref, split = read(tmp_path / "labels.parquet", tmp_path / "home")
    assert classes_by_file(ref, split) == expected(rows)


@pytest.mark.parametrize(("row", "problem"), [
    ("images/gone.jpg,cat,train", "row 26: image images/gone.jpg does not exist"),
    ("images/cat00.jpg,cat,holdout", "row 26: split 'holdout' is not one of train"),
    ("images/cat00.jpg,,train", "row 26: images/cat00.jpg has no class"),
    ("images/cat00.jpg,cat,", "row 26: no split, where other rows name one"),
    ("s3://team-bucket/cat00.jpg,cat,train", "row 26: s3://team-bucket/cat00.jpg is in object"),
])
def test_a_bad_row_is_named_before_anything_is_decoded(tmp_path, row, problem):
    rows = images(tmp_path)
    side = sides_of(rows)
    lines = ["path,label,split", *(f"{p},{label},{side[p]}" for p, label in rows), row]
    (tmp_path / "labels.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=problem.replace("(", r"\(")):
        prepare(DatasetSpec(source=str(tmp_path / "labels.csv")), tmp_path / "home")
    assert not (tmp_path / "home" / "splits").exists()


def test_several_classes_on_one_image_are_refused_with_the_row(tmp_path):
    rows = images(tmp_path)
    (tmp_path / "metadata.jsonl").write_text("".join(
        json.dumps({"file_name": p, "labels": [label, "pet"] if i == 3 else [label]}) + "\n"
        for i, (p, label) in enumerate(rows)))
    with pytest.raises(DatasetError, match="row 4: images/cat03.jpg has 2 classes"):
        prepare(DatasetSpec(source=str(tmp_path / "metadata.jsonl")), tmp_path / "home")


@pytest.mark.slow
def test_train_flow_trains_gates_and_serves_from_a_manifest(prefect_engine, session_home,
                                                            tmp_path):
    import base64

    import mlflow
    import pandas as pd
    from mlflow import MlflowClient

    from flows.train_flow import train_flow
    from training.storage import tracking_uri

    rows = images(tmp_path)
    side = sides_of(rows)
    (tmp_path / "metadata.jsonl").write_text("".join(
        json.dumps({"file_name": p, "label": label, "split": side[p]}) + "\n"
        for p, label in rows))
    result = train_flow(dataset={"source": str(tmp_path / "metadata.jsonl")},
                        training={"epochs": 1, "image_size": 16, "batch_size": 8},
                        registry={"model_name": "manifest-pets"})
    assert result.registration.version == "1"
    assert sum(result.trained.job.split.counts["test"].values()) == 4
    mlflow.set_tracking_uri(tracking_uri())
    served = mlflow.pyfunc.load_model("models:/manifest-pets/1")
    image = base64.b64encode((tmp_path / rows[0][0]).read_bytes()).decode()
    answer = served.predict(pd.DataFrame({"image": [image]}))
    assert answer["label"][0] in ("cat", "dog")
    # The generated photos include near-copies (a shape moved by a pixel): a given split is
    # never changed, so those across it are reported, not moved.
    run = MlflowClient(tracking_uri()).get_run(result.mlflow_run_id)
    assert run.data.metrics["test_accuracy"] == result.evaluation.metrics["accuracy"]
    assert run.data.tags["trainflow.dataset.source"] == str(tmp_path / "metadata.jsonl")
    assert "audit_duplicate_groups" in run.data.metrics
