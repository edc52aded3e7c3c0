"""The watch's comparison of a folder with its baseline: file lists and sizes, no decoding."""

from __future__ import annotations

import os

from tests.imagegen import photo, write_folder_layout
from training.config import DatasetSpec
from training.data.watch import compare, listing, watchable


def test_new_changed_and_removed_images_are_counted_per_class(tmp_path):
    write_folder_layout(tmp_path, {"cat": 5, "dog": 5})
    spec = DatasetSpec(source=str(tmp_path))
    before = listing(spec)
    assert len(before) == 10 and compare(before, listing(spec)).any is False

    photo("cat", 99, size=40).save(tmp_path / "cat" / "img000.png")  # rewritten in place
    (tmp_path / "dog" / "img004.png").unlink()
    (tmp_path / "bird").mkdir()
    for i in range(3):
        photo("bird", i).save(tmp_path / "bird" / f"b{i}.png")
    os.rename(tmp_path / "dog" / "img003.png", tmp_path / "cat" / "was-a-dog.png")  # relabelled
    changes = compare(before, listing(spec))
    assert changes.new == {"bird": 3, "cat": 1}
    assert changes.changed == {"cat": 1}
    assert changes.removed == {"dog": 2}
    assert changes.new_or_changed == 5 and changes.images == 12


def test_a_relabelled_row_of_a_label_file_counts_as_changed(tmp_path):
    for i in range(4):
        photo("cat", i).save(tmp_path / f"{i}.png")
    labels = tmp_path / "labels.csv"
    labels.write_text("file,label\n" + "".join(f"{i}.png,cat\n" for i in range(4)))
    spec = DatasetSpec(source=str(tmp_path), labels="csv:labels.csv")
    before = listing(spec)
    labels.write_text("file,label\n0.png,dog\n" + "".join(f"{i}.png,cat\n" for i in range(1, 4)))
    changes = compare(before, listing(spec))
    assert (changes.new, changes.changed, changes.removed) == ({}, {"dog": 1}, {})


def test_only_folders_are_watched():
    assert watchable(DatasetSpec(source="/data/photos"))
    assert not watchable(DatasetSpec(source="builtin:digits"))
    assert not watchable(DatasetSpec(source="kaggle:competitions/dogs-vs-cats-redux-kernels-edition"))


def test_a_deployment_whose_folder_is_not_there_yet_is_skipped_with_a_note(tmp_path, home):
    from tasks.watch import WatchedDeployment, watch_deployment
    from training.config import RetrainSpec

    deployment = WatchedDeployment(id="0", name="train-flow/photos", retrain=RetrainSpec(),
                                   dataset=DatasetSpec(source=str(tmp_path / "photos")))
    watched = watch_deployment.fn(deployment)
    assert watched.changes is None and not watched.due
    assert watched.note == f"no folder {tmp_path / 'photos'}"
