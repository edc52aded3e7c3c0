"""Data in the forms users hold it: torchvision's catalogue (MNIST's IDX files, CIFAR's pickled
batches) and Hugging Face datasets (parquet with image bytes), from real-format files. Their
own test split is the test split; the rows are decoded straight into the store."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.formats import CIFAR_NAMES, write_cifar10, write_hf_parquet, write_idx, write_mnist
from training.config import DatasetSpec, SplitSpec
from training.data.images import decode_image
from training.data.labels import DatasetError
from training.data.rows import image_bytes
from training.data.sources import prepare
from training.data.split import read_manifest, split_dataset
from training.data.store import DecodeStore

MNIST_CLASSES = ["0 - zero", "1 - one", "2 - two", "3 - three", "4 - four", "5 - five",
                 "6 - six", "7 - seven", "8 - eight", "9 - nine"]


def _split(spec: DatasetSpec, home, side: int):
    ref = prepare(spec, home)
    return ref, split_dataset(ref, SplitSpec(), home, {"train": side, "val": side, "test": side})


def _stored(result, home, side: int, paths: list[str]) -> np.ndarray:
    folder = result.manifest.parent.parent
    store = DecodeStore(folder, side)
    with store.locked(exclusive=False) as index:
        found = store.lookup(index, paths)
    return np.asarray(found.images[found.rows])


def test_mnist_idx_files_keep_their_official_test_split_and_their_pixels(tmp_path, home):
    written = write_mnist(tmp_path / "tv", train=300, test=100)
    ref, result = _split(DatasetSpec(source="torchvision:MNIST", root=str(tmp_path / "tv")),
                         home, 28)
    assert ref.class_names == MNIST_CLASSES  # torchvision's own names, in its order
    rows = read_manifest(result.manifest)
    by_split = {s: [p for p, _, sp in rows if sp == s] for s in ("train", "val", "test")}
    assert len(by_split["test"]) == 100 and all(p.startswith("test/") for p in by_split["test"])
    assert not any(p.startswith("test/") for p in by_split["train"] + by_split["val"])
    assert len(by_split["train"]) + len(by_split["val"]) == 300
    assert result.counts["val"] == {name: 3 for name in MNIST_CLASSES}  # 0.1 of train, by class
    assert result.channels == 1 and result.given_splits == {"test": "test", "train": "train"}
    # Each row is the IDX file's pixels, decoded once into the store, never into files.
    images, labels = written["test"]
    stored = _stored(result, home, 28, by_split["test"])
    for path, pixels in zip(by_split["test"], stored, strict=True):
        row = int(path.rpartition("#")[2])
        assert np.array_equal(pixels[0], images[row])
        assert dict((p, lbl) for p, lbl, _ in rows)[path] == MNIST_CLASSES[labels[row]]
    assert not list(home.rglob("*.png"))
    # Rows at the array's own size are copied, not decoded one by one: the same pixels as
    # the per-image decode (and PIL's resize at any other size) gives.
    for path, pixels in list(zip(by_split["test"], stored, strict=True))[:5]:
        assert np.array_equal(decode_image(result.root / path, 28)[0], pixels)
    small = _stored(_split(DatasetSpec(source="torchvision:MNIST", root=str(tmp_path / "tv")),
                           home, 14)[1], home, 14, by_split["test"][:3])
    for path, pixels in zip(by_split["test"][:3], small, strict=True):
        expected = Image.fromarray(images[int(path[-7:])]).resize((14, 14), Image.BILINEAR)
        assert np.array_equal(pixels[0], np.asarray(expected))
    # What the served model is given for a row: a PNG of exactly those pixels.
    served = Image.open(__import__("io").BytesIO(image_bytes(result.root / by_split["test"][0])))
    assert np.array_equal(np.asarray(served), images[int(by_split["test"][0][-7:])])
    # The same files again: the same split, and the tables are not read again.
    table = result.root / "table.json"
    stamp = table.stat().st_mtime_ns
    assert _split(DatasetSpec(source="torchvision:MNIST", root=str(tmp_path / "tv")),
                  home, 28)[1].manifest_sha256 == result.manifest_sha256
    assert table.stat().st_mtime_ns == stamp


def test_cifar_batches_give_their_class_names_and_test_batch(tmp_path, home):
    written = write_cifar10(tmp_path / "tv", per_batch=20, test=30)
    ref, result = _split(DatasetSpec(source="torchvision:CIFAR10", root=str(tmp_path / "tv")),
                         home, 32)
    assert ref.class_names == CIFAR_NAMES
    assert ref.class_counts == {name: 13 for name in CIFAR_NAMES}
    rows = read_manifest(result.manifest)
    tests = [p for p, _, s in rows if s == "test"]
    assert len(tests) == 30 and {p.split("/")[0] for p in tests} == {"test"}
    assert result.channels == 3
    images, labels = written["test"]
    stored = _stored(result, home, 32, tests)
    for path, pixels in zip(tests, stored, strict=True):
        assert np.array_equal(pixels.transpose(1, 2, 0), images[int(path[-7:])])


READ_AS_TORCHVISION = """
import json, sys
from pathlib import Path
import numpy as np
from training.config import DatasetSpec
from training.data.tables import prepare_tables
home, data = Path(sys.argv[1]), sys.argv[2]
roots = {name: prepare_tables(DatasetSpec(source=f"torchvision:{name}", root=data), home)
         for name in ("MNIST", "FashionMNIST", "KMNIST", "CIFAR10")}
seen = {"torch imported": "torch" in sys.modules}
import torchvision.datasets as catalogue
for name in ("MNIST", "FashionMNIST", "KMNIST"):
    cls = getattr(catalogue, name)
    same = json.loads((roots[name] / "table.json").read_text())["class_names"] == cls.classes
    for split, train in (("train", True), ("test", False)):
        ds = cls(data, train=train)
        same = same and np.array_equal(np.load(roots[name] / split / "images.npy"),
                                       ds.data.numpy())
        same = same and np.array_equal(np.load(roots[name] / split / "labels.npy"),
                                       ds.targets.numpy())
    seen[name] = same
print(json.dumps(seen))
"""


def test_mnist_and_cifar_files_read_as_torchvision_reads_them_without_importing_torch(tmp_path):
    """The flow's process reads these layouts itself (torch's import costs more than reading
    70,000 digits): the same arrays, labels and class names as torchvision's own classes."""
    for name, train in (("MNIST", 40), ("FashionMNIST", 50), ("KMNIST", 60)):
        write_mnist(tmp_path / "tv", train=train, test=20, name=name)
    write_cifar10(tmp_path / "tv", per_batch=4, test=10)
    done = subprocess.run([sys.executable, "-c", READ_AS_TORCHVISION, str(tmp_path / "home"),
                           str(tmp_path / "tv")], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "torch imported": False, "MNIST": True, "FashionMNIST": True, "KMNIST": True}


def test_a_cifar_batch_that_would_run_code_is_refused_unopened(tmp_path, home):
    write_cifar10(tmp_path / "tv", per_batch=10, test=10)

    class Payload:
        def __reduce__(self):
            return (print, ("this ran",))

    with open(tmp_path / "tv" / "cifar-10-batches-py" / "data_batch_3", "wb") as f:
        pickle.dump({b"data": Payload(), b"labels": [0]}, f)
    with pytest.raises(DatasetError, match="builtins.print is not allowed") as error:
        prepare(DatasetSpec(source="torchvision:CIFAR10", root=str(tmp_path / "tv")), home)
    assert "data_batch_3" in str(error.value)


def test_a_hugging_face_parquet_dataset_keeps_its_splits_and_class_labels(tmp_path, home):
    names = ["circle", "square", "star"]
    written = write_hf_parquet(tmp_path / "hub", {"train": 45, "validation": 12, "test": 15},
                               names, image_column="picture", label_column="kind")
    spec = DatasetSpec(source=f"hf:{tmp_path / 'hub'}", image_column="picture",
                       label_column="kind")
    ref, result = _split(spec, home, 20)
    assert ref.class_names == names
    counts = {s: sum(c.values()) for s, c in result.counts.items()}
    assert counts == {"train": 45, "val": 12, "test": 15}
    rows = read_manifest(result.manifest)
    assert {p.split("/")[0]: s for p, _, s in rows} == {"train": "train", "val": "val",
                                                        "test": "test"}
    # The parquet's bytes are the row's bytes: what the served model reads is the source's.
    path, label, _ = next(r for r in rows if r[2] == "test")
    data, index = written["test"][int(path[-7:])]
    assert image_bytes(result.root / path) == data and label == names[index]
    assert Counter(lbl for _, lbl, s in rows if s == "test") == {n: 5 for n in names}


def test_malformed_sources_are_named_before_any_training(tmp_path, home):
    write_mnist(tmp_path / "bad", train=20, test=10)
    raw = tmp_path / "bad" / "MNIST" / "raw"
    images = raw / "t10k-images-idx3-ubyte"
    images.write_bytes(b"\x00\x00\x08\x04" + images.read_bytes()[4:])
    with pytest.raises(DatasetError, match="magic number is 0x00000804, expected 0x00000803"):
        prepare(DatasetSpec(source="torchvision:MNIST", root=str(tmp_path / "bad")), home)

    write_mnist(tmp_path / "range", train=20, test=10)
    labels = np.arange(10) % 10
    labels[4] = 12
    write_idx(tmp_path / "range" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte", labels, 0x0801)
    with pytest.raises(DatasetError, match="1 labels outside the 10 classes, first 12 at row 4"):
        prepare(DatasetSpec(source="torchvision:MNIST", root=str(tmp_path / "range")), home)

    write_hf_parquet(tmp_path / "hub", {"train": 6, "test": 3}, ["a", "b", "c"])
    with pytest.raises(DatasetError, match="has no column 'digit' .*set dataset.image_column"):
        prepare(DatasetSpec(source=f"hf:{tmp_path / 'hub'}", label_column="digit"), home)

    with pytest.raises(DatasetError) as missing:
        prepare(DatasetSpec(source="torchvision:FashionMNIST", root=str(tmp_path / "empty")),
                home)
    assert f"{tmp_path / 'empty'} lacks FashionMNIST/raw/train-images-idx3-ubyte" in \
        str(missing.value)
    assert "dataset.root" in str(missing.value)


@pytest.mark.parametrize(("fields", "needle"), [
    ({"source": "torchvision:Mnist"}, "unknown torchvision dataset 'Mnist'"),
    ({"source": "torchvision:MNIST", "labels": "filename"}, "leave dataset.labels"),
    ({"source": "builtin:digits", "root": "/data"}, "dataset.root is the folder of a torchvision"),
    ({"source": "builtin:digits", "label_column": "y"}, "columns of an \"hf:\" source"),
])
def test_source_fields_are_checked_when_the_parameters_are_read(fields, needle):
    with pytest.raises(ValueError, match=needle):
        DatasetSpec(**fields)


@pytest.mark.slow
def test_the_flow_trains_on_torchvision_mnist_and_tests_on_its_official_test_set(
        prefect_engine, session_home, tmp_path):
    from mlflow import MlflowClient

    from flows.train_flow import train_flow
    from training.storage import tracking_uri

    write_mnist(tmp_path / "tv", train=400, test=120)
    params = {"dataset": {"source": "torchvision:MNIST", "root": str(tmp_path / "tv")},
              "training": {"epochs": 2, "image_size": 16, "batch_size": 32},
              "registry": {"model_name": "tv-mnist"}}
    result = train_flow(**params)
    run = MlflowClient(tracking_uri()).get_run(result.mlflow_run_id)
    assert run.data.params["world_size"] == "2"
    assert result.trained.job.split.counts["test"] == {name: 12 for name in MNIST_CLASSES}
    assert run.data.metrics["test_accuracy"] > 0.5  # chance: 0.1
    contexts = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
    assert contexts["test"].name == "torchvision:MNIST test"
    assert "as given: test/ as test, train/ as train; val carved from train" in \
        run.data.tags["mlflow.note.content"]
    assert result.registration.promoted
    # The champion is judged again on the same 120 official test images by the gate: served
    # from the rows' bytes, it agrees with the training's own evaluation.
    again = train_flow(**params, force=True)
    gate = again.registration
    assert gate.compared_images == 120 and gate.metric == "accuracy"
    assert gate.champion_value == pytest.approx(run.data.metrics["test_accuracy"], abs=1e-9)


def test_hugging_face_labels_without_a_class_label_are_named_by_their_values(tmp_path, home):
    import datasets

    from tests.formats import digit_like, png

    for split, count in (("train", 20), ("test", 6)):
        kinds = ["round" if i % 2 else "flat" for i in range(count)]
        datasets.Dataset.from_dict(
            {"image": [{"bytes": png(digit_like(i % 2, i)), "path": None} for i in range(count)],
             "label": kinds},
            features=datasets.Features({"image": datasets.Image(),
                                        "label": datasets.Value("string")}),
        ).to_parquet(tmp_path / "hub" / f"{split}.parquet")
    ref, result = _split(DatasetSpec(source=f"hf:{tmp_path / 'hub'}"), home, 28)
    assert ref.class_names == ["flat", "round"]
    assert result.counts["test"] == {"flat": 3, "round": 3}


@pytest.mark.slow
def test_the_flow_trains_on_a_hugging_face_parquet_dataset(prefect_engine, session_home,
                                                          tmp_path):
    from mlflow import MlflowClient

    from flows.train_flow import train_flow
    from training.storage import tracking_uri

    names = ["low", "middle", "high"]
    write_hf_parquet(tmp_path / "hub", {"train": 240, "test": 60}, names)
    result = train_flow(dataset={"source": f"hf:{tmp_path / 'hub'}"},
                        training={"epochs": 2, "image_size": 16, "batch_size": 16},
                        registry={"model_name": "hf-bars"})
    run = MlflowClient(tracking_uri()).get_run(result.mlflow_run_id)
    assert result.trained.job.split.counts["test"] == {n: 20 for n in names}
    assert result.trained.class_names == sorted(names)
    assert run.data.metrics["test_accuracy"] > 0.5 and result.registration.promoted


def test_an_image_file_with_a_hash_in_its_name_is_a_file_not_a_row(tmp_path, home):
    from tests.imagegen import photo

    for label in ("cat", "dog"):
        (tmp_path / "pets" / label).mkdir(parents=True)
        for i in range(10):
            photo(label, i).save(tmp_path / "pets" / label / f"{label}#{i}.png")
    ref, result = _split(DatasetSpec(source=str(tmp_path / "pets")), home, 24)
    assert result.quarantined == 0 and ref.image_count == 20
    path = read_manifest(result.manifest)[0][0]
    assert "#" in path
    assert np.array_equal(_stored(result, home, 24, [path])[0],
                          decode_image(result.root / path, 24)[0])


def test_a_hugging_face_dataset_with_only_a_train_split_has_its_test_split_carved(tmp_path,
                                                                                  home):
    write_hf_parquet(tmp_path / "hub", {"train": 60}, ["a", "b", "c"])
    _, result = _split(DatasetSpec(source=f"hf:{tmp_path / 'hub'}"), home, 20)
    assert result.given_splits is None
    assert result.counts["test"] == {"a": 2, "b": 2, "c": 2}  # test_fraction 0.1 of each class
