"""split: determinism, stability under growth, stratification, quarantine and its limits."""

import hashlib
import json

import pytest
from PIL import Image

from tests.imagegen import write_filename_layout
from training.config import DatasetSpec, SplitSpec
from training.data.labels import DatasetError
from training.data.sources import prepare
from training.data.split import read_manifest, split_dataset


def _split(folder, home, sides=None, **split):
    ref = prepare(DatasetSpec(source=str(folder), labels="filename"), home)
    return split_dataset(ref, SplitSpec(**split), home, sides)


# The flow's split decodes each image at its training side; a split alone only checks.
both_checks = pytest.mark.parametrize("sides", [None, {"train": 14, "val": 12, "test": 12}],
                                      ids=["check-only", "decode-once"])


def test_digits_split_is_stratified(digits_split):
    ref, result = digits_split
    assert sum(sum(c.values()) for c in result.counts.values()) == 1797
    for name, n in ref.class_counts.items():
        for split, fraction in (("val", 0.1), ("test", 0.1)):
            assert abs(result.counts[split][name] - n * fraction) <= 1
    assert result.channels == 1 and result.quarantined == 0


def test_same_inputs_give_identical_bytes(tmp_path):
    write_filename_layout(tmp_path / "d", {"cat": 30, "dog": 20})
    first = _split(tmp_path / "d", tmp_path / "home1")
    second = _split(tmp_path / "d", tmp_path / "home2")  # a fresh machine, no history
    assert first.manifest.read_bytes() == second.manifest.read_bytes()
    assert first.manifest_sha256 == hashlib.sha256(first.manifest.read_bytes()).hexdigest()
    assert first.counts == {"train": {"cat": 24, "dog": 16}, "val": {"cat": 3, "dog": 2},
                            "test": {"cat": 3, "dog": 2}}


def test_seed_changes_the_assignment(tmp_path):
    write_filename_layout(tmp_path / "d", {"cat": 30, "dog": 30})
    a = read_manifest(_split(tmp_path / "d", tmp_path / "h", seed=1).manifest)
    b = read_manifest(_split(tmp_path / "d", tmp_path / "h", seed=2).manifest)
    assert a != b


def test_adding_images_never_moves_old_ones(tmp_path, home):
    folder = tmp_path / "d"
    write_filename_layout(folder, {"cat": 40, "dog": 40})
    before = {p: s for p, _, s in read_manifest(_split(folder, home).manifest)}
    write_filename_layout(folder, {"cat": 25, "dog": 15}, start=40)
    grown = _split(folder, home)
    after = {p: s for p, _, s in read_manifest(grown.manifest)}
    assert len(after) == 120
    assert all(after[p] == s for p, s in before.items())
    for name, n in {"cat": 65, "dog": 55}.items():
        assert abs(grown.counts["test"][name] - 0.1 * n) <= 1
        assert abs(grown.counts["val"][name] - 0.1 * n) <= 1


@both_checks
def test_corrupt_files_are_quarantined_not_fatal(tmp_path, home, sides):
    folder = tmp_path / "d"
    write_filename_layout(folder, {"cat": 40, "dog": 40})
    good = (folder / "cat.0.jpg").read_bytes()
    (folder / "cat.0.jpg").write_bytes(good[: len(good) // 2])  # truncated JPEG
    (folder / "dog.0.jpg").write_bytes(b"")  # zero bytes
    (folder / "dog.1.jpg").write_text("not an image at all")
    Image.new("RGBA", (20, 20), (255, 0, 0, 128)).save(folder / "cat.1.png")  # RGBA: kept
    Image.new("L", (20, 20), 128).save(folder / "cat.2.jpg")  # grayscale in RGB data: kept
    result = _split(folder, home, sides)
    report = json.loads((result.manifest.parent / "quarantine.json").read_text())
    assert {r["path"] for r in report} == {"cat.0.jpg", "dog.0.jpg", "dog.1.jpg"}
    assert result.quarantined == 3
    kept = {p for p, _, _ in read_manifest(result.manifest)}
    assert {"cat.1.png", "cat.2.jpg"} <= kept and "cat.0.jpg" not in kept
    assert result.channels == 3


@both_checks
def test_decompression_bomb_is_refused_by_size(tmp_path, home, sides):
    folder = tmp_path / "d"
    write_filename_layout(folder, {"cat": 30, "dog": 30})
    Image.new("1", (8000, 6000)).save(folder / "cat.bomb.png")  # 48 MP, a tiny file
    result = _split(folder, home, sides)
    report = json.loads((result.manifest.parent / "quarantine.json").read_text())
    assert [r["path"] for r in report] == ["cat.bomb.png"]
    assert "pixel limit" in report[0]["reason"]


@both_checks
def test_too_many_unreadable_files_stop_the_run(tmp_path, home, sides):
    folder = tmp_path / "d"
    write_filename_layout(folder, {"cat": 20, "dog": 20})
    for i in range(3):
        (folder / f"cat.{i}.jpg").write_bytes(b"\xff\xd8broken")
    with pytest.raises(DatasetError, match="3 of 40 images are unreadable"):
        _split(folder, home, sides)


def test_one_class_and_tiny_classes_are_refused(tmp_path, home):
    write_filename_layout(tmp_path / "one", {"cat": 20})
    with pytest.raises(DatasetError, match="one class"):
        _split(tmp_path / "one", home)
    write_filename_layout(tmp_path / "tiny", {"cat": 20, "dog": 3})
    with pytest.raises(DatasetError, match="class 'dog' has 3 readable images.*at least 6"):
        _split(tmp_path / "tiny", home)


@pytest.mark.parametrize("kept", [0.5, 0.9, 0.99])
def test_a_jpeg_cut_anywhere_is_caught_by_the_reduced_scale_check(tmp_path, kept):
    """The check decodes JPEG pixels at 1/8 scale; every compressed byte is still read."""
    from training.data.images import check_image

    Image.effect_noise((400, 300), 60).convert("RGB").save(tmp_path / "whole.jpg", quality=95)
    data = (tmp_path / "whole.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: int(len(data) * kept)])
    assert check_image(tmp_path, "whole.jpg").ok
    verdict = check_image(tmp_path, "cut.jpg")
    assert not verdict.ok and "truncated" in verdict.reason
