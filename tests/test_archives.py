"""Zip extraction refuses traversal, absolute paths, links and bombs before writing anything."""

import io
import stat
import zipfile

import pytest

from training.data.archives import UnsafeArchiveError, extract_zip


def _zip(path, entries):
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries:
            if isinstance(data, zipfile.ZipInfo):
                zf.writestr(data, b"target")
            else:
                zf.writestr(name, data)
    return path


def _symlink_entry(name):
    info = zipfile.ZipInfo(name)
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info


@pytest.mark.parametrize(("entries", "needle"), [
    ([("ok.txt", "x"), ("../evil.txt", "x")], "outside the target folder"),
    ([("a/../../evil.txt", "x")], "outside the target folder"),
    ([("/tmp/evil.txt", "x")], "outside the target folder"),
    ([("link", _symlink_entry("link"))], "symbolic link"),
    ([("bomb.bin", b"\0" * (300 << 20))], "zip bomb"),
])
def test_unsafe_archives_are_refused_with_nothing_written(tmp_path, entries, needle):
    archive = _zip(tmp_path / "a.zip", [(n, d) for n, d in entries])
    target = tmp_path / "out" / "data"
    target.parent.mkdir()
    with pytest.raises(UnsafeArchiveError, match=needle):
        extract_zip(archive, target)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []
    assert not (tmp_path / "evil.txt").exists()


def test_nested_zip_is_extracted_like_dogs_vs_cats(tmp_path):
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        zf.writestr("train/cat.0.jpg", b"jpeg")
    _zip(tmp_path / "comp.zip", [("train.zip", inner.getvalue()), ("sample.csv", "id\n")])
    target = extract_zip(tmp_path / "comp.zip", tmp_path / "data")
    assert (target / "train" / "cat.0.jpg").read_bytes() == b"jpeg"
    assert not (target / "train.zip").exists()


def test_nested_zip_with_traversal_is_refused(tmp_path):
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        zf.writestr("../../escape.txt", b"x")
    _zip(tmp_path / "comp.zip", [("train.zip", inner.getvalue())])
    with pytest.raises(UnsafeArchiveError, match="outside the target"):
        extract_zip(tmp_path / "comp.zip", tmp_path / "data")
    assert not (tmp_path / "data").exists()
    assert not (tmp_path / "escape.txt").exists()
