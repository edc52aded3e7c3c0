"""prepare: the built-in digits, local folders and the three label layouts, on real files."""

import csv

import pytest
from PIL import Image

from tests.imagegen import write_filename_layout, write_folder_layout
from training.config import DatasetSpec
from training.data.labels import DatasetError
from training.data.sources import prepare


def test_digits_are_written_once_as_real_pngs(home):
    ref = prepare(DatasetSpec(source="builtin:digits"), home)
    assert ref.image_count == 1797
    assert ref.class_names == [str(d) for d in range(10)]
    assert sum(ref.class_counts.values()) == 1797
    pngs = sorted(ref.root.rglob("*.png"))
    assert len(pngs) == 1797
    with Image.open(pngs[0]) as img:
        assert img.format == "PNG" and img.size == (8, 8) and img.mode == "L"
    mtime = pngs[0].stat().st_mtime_ns
    again = prepare(DatasetSpec(source="builtin:digits"), home)
    assert again.fingerprint == ref.fingerprint
    assert pngs[0].stat().st_mtime_ns == mtime  # not rewritten


def test_folder_layout(tmp_path, home):
    write_folder_layout(tmp_path / "pets", {"cat": 5, "dog": 4})
    ref = prepare(DatasetSpec(source=str(tmp_path / "pets")), home)
    assert ref.class_counts == {"cat": 5, "dog": 4}


def test_filename_layout_with_subdir(tmp_path, home):
    write_filename_layout(tmp_path / "dvc" / "train", {"cat": 3, "dog": 6})
    ref = prepare(DatasetSpec(source=str(tmp_path / "dvc"), labels="filename", subdir="train"),
                  home)
    assert ref.class_counts == {"cat": 3, "dog": 6}
    assert ref.root == (tmp_path / "dvc" / "train").resolve()


def test_csv_layout(tmp_path, home):
    paths = write_filename_layout(tmp_path / "data" / "img", {"a": 2, "b": 2}, fmt="PNG")
    with open(tmp_path / "data" / "labels.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["file", "label"])
        for p in paths:
            writer.writerow([p.name, "even" if int(p.name.split(".")[1]) % 2 == 0 else "odd"])
    ref = prepare(DatasetSpec(source=str(tmp_path / "data"), labels="csv:labels.csv",
                              subdir="img"), home)
    assert ref.class_counts == {"even": 2, "odd": 2}


def test_fingerprint_changes_with_content(tmp_path, home):
    write_folder_layout(tmp_path / "pets", {"cat": 3, "dog": 3})
    spec = DatasetSpec(source=str(tmp_path / "pets"))
    first = prepare(spec, home).fingerprint
    assert prepare(spec, home).fingerprint == first
    Image.new("RGB", (9, 9), "white").save(tmp_path / "pets" / "cat" / "img000.png")
    changed = prepare(spec, home).fingerprint
    assert changed != first
    (tmp_path / "pets" / "dog" / "img000.png").unlink()
    assert prepare(spec, home).fingerprint not in (first, changed)


@pytest.mark.parametrize(("make", "spec", "needle"), [
    (lambda p: None, {"source": "{p}/missing"}, "does not exist"),
    (lambda p: write_folder_layout(p / "d", {"a": 2}), {"source": "{p}/d", "subdir": "nope"},
     "check dataset.source and dataset.subdir"),
    (lambda p: write_filename_layout(p / "d", {"a": 2}), {"source": "{p}/d"},
     'use labels="filename"'),
    (lambda p: (p / "d").mkdir(), {"source": "{p}/d", "labels": "csv:l.csv"},
     "label file"),
])
def test_bad_sources_get_clear_errors(tmp_path, home, make, spec, needle):
    make(tmp_path)
    fields = {k: v.format(p=tmp_path) for k, v in spec.items()}
    with pytest.raises(DatasetError, match=needle):
        prepare(DatasetSpec(**fields), home)


def test_csv_with_missing_columns_or_files(tmp_path, home):
    write_filename_layout(tmp_path / "d", {"a": 2})
    (tmp_path / "d" / "l.csv").write_text("filename,class\na.0.jpg,a\n")
    with pytest.raises(DatasetError, match="must have columns file,label; it has filename,class"):
        prepare(DatasetSpec(source=str(tmp_path / "d"), labels="csv:l.csv"), home)
    (tmp_path / "d" / "l.csv").write_text("file,label\na.0.jpg,a\nghost.jpg,b\n")
    with pytest.raises(DatasetError, match="names 1 files missing .*ghost.jpg"):
        prepare(DatasetSpec(source=str(tmp_path / "d"), labels="csv:l.csv"), home)
