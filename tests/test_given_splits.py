"""Folders that come split (train/, val/ or valid/, test/): their splits are kept as given."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.imagegen import photo
from training.config import DatasetSpec, SplitSpec
from training.data.labels import DatasetError
from training.data.sources import prepare
from training.data.split import read_manifest, split_dataset


def write_split_tree(root, splits: dict[str, dict[str, int]], size: tuple[int, int] | None = None,
                     drawn_as: dict[str, str] | None = None, ext: str = "png"
                     ) -> dict[str, set[str]]:
    """root/<split>/<class>/<n>.<ext>, every image different (`size`: resized to it, aspect
    and all; `drawn_as`: a class drawn as another's photos, e.g. ants as cats); returns
    split -> relative paths."""
    written: dict[str, set[str]] = {}
    offset = 0
    for split, counts in splits.items():
        for label, n in counts.items():
            (root / split / label).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                image = photo((drawn_as or {}).get(label, label), offset + i,
                              max(size) if size else 24)
                (image.resize(size) if size else image).save(
                    root / split / label / f"{offset + i}.{ext}")
                written.setdefault(split, set()).add(f"{split}/{label}/{offset + i}.{ext}")
            offset += n
    return written


def _split(root, home, **split):
    ref = prepare(DatasetSpec(source=str(root)), home)
    return ref, split_dataset(ref, SplitSpec(**split), home,
                              {"train": 14, "val": 12, "test": 12})


def test_the_given_test_folder_is_the_test_split_and_val_is_carved_from_train(tmp_path, home):
    written = write_split_tree(tmp_path / "data", {"train": {"cat": 30, "dog": 20},
                                                   "test": {"cat": 6, "dog": 5}})
    ref, result = _split(tmp_path / "data", home)
    assert ref.class_names == ["cat", "dog"]  # the class folders, not train/ and test/
    rows = read_manifest(result.manifest)
    by_split = {s: {p for p, _, sp in rows if sp == s} for s in ("train", "val", "test")}
    assert by_split["test"] == written["test"]
    assert by_split["train"] | by_split["val"] == written["train"]
    assert result.counts["val"] == {"cat": 3, "dog": 2}  # val_fraction 0.1 of each class
    assert result.given_splits == {"test": "test", "train": "train"}
    from tasks.report import how_split  # what the run's description says of it

    assert how_split(result) == "as given: test/ as test, train/ as train; val carved from train"
    # The same tree split again: the same bytes.
    assert _split(tmp_path / "data", home)[1].manifest_sha256 == result.manifest_sha256


def test_a_given_valid_folder_is_the_val_split(tmp_path, home):
    written = write_split_tree(tmp_path / "data", {"train": {"cat": 8, "dog": 8},
                                                   "valid": {"cat": 2, "dog": 3},
                                                   "test": {"cat": 2, "dog": 2}})
    _, result = _split(tmp_path / "data", home)
    rows = read_manifest(result.manifest)
    assert {p for p, _, s in rows if s == "val"} == written["valid"]
    assert {p for p, _, s in rows if s == "test"} == written["test"]
    assert result.counts["train"] == {"cat": 8, "dog": 8}


def test_respect_given_false_splits_all_images_anew_with_the_same_classes(tmp_path, home):
    write_split_tree(tmp_path / "data", {"train": {"cat": 30, "dog": 30},
                                         "test": {"cat": 10, "dog": 10}})
    ref, result = _split(tmp_path / "data", home, respect_given=False)
    assert ref.class_names == ["cat", "dog"] and result.given_splits is None
    tests = [p for p, _, s in read_manifest(result.manifest) if s == "test"]
    assert Counter(p.split("/")[0] for p in tests) != Counter({"test": len(tests)})


@pytest.mark.parametrize(("splits", "needle"), [
    ({"train": {"cat": 8, "dog": 8}, "test": {}}, "split folder {root}/test has no images"),
    ({"train": {"cat": 8, "dog": 8}, "test": {"cat": 3}},
     "the test split of {root} has no readable images of class 'dog'"),
    ({"train": {"cat": 8, "dog": 8}, "val": {"cat": 1, "dog": 1}, "valid": {"cat": 1, "dog": 1},
      "test": {"cat": 2, "dog": 2}}, "more than one validation folder (val, valid)"),
])
def test_a_given_split_that_cannot_be_used_names_the_folder(tmp_path, home, splits, needle):
    root = tmp_path / "data"
    write_split_tree(root, splits)
    (root / "test").mkdir(parents=True, exist_ok=True)
    with pytest.raises(DatasetError) as error:
        _split(root, home)
    assert needle.format(root=root.resolve()) in str(error.value)
