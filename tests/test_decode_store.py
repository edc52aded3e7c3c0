"""The decode store: each image decoded once per side, by the split, and found by training."""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image

from tests.imagegen import photo, write_filename_layout
from trainflow_serving.images import load_resized
from training.config import DatasetSpec, SplitSpec
from training.data import decode_pass
from training.data.cache import decode_split
from training.data.sources import prepare
from training.data.split import read_manifest, split_dataset

SIDES = {"train": 14, "val": 12, "test": 12}


class Decodes:
    """Counts what a pass decoded, through the progress it reports (what a user's bar shows)."""

    def __init__(self):
        self.totals: list[int] = []

    def __call__(self, done: int, total: int) -> None:
        if done == total:
            self.totals.append(total)

    @property
    def count(self) -> int:
        return sum(self.totals)


def _split(folder, home, sides=SIDES, **split):
    decodes = Decodes()
    ref = prepare(DatasetSpec(source=str(folder), labels="filename"), home)
    return split_dataset(ref, SplitSpec(**split), home, sides, decodes), decodes.count


def _training_decodes(result, sides=SIDES, channels=3) -> int:
    decodes = Decodes()
    for name, side in sides.items():
        decode_split(result, name, side, channels, decodes)
    return decodes.count


def test_each_image_is_decoded_once_and_grown_data_decodes_only_new_files(tmp_path, home):
    folder = tmp_path / "d"
    write_filename_layout(folder, {"cat": 40, "dog": 40}, size=40)
    first, decoded = _split(folder, home)
    assert decoded == 80
    assert _training_decodes(first) == 0  # the training launch finds every image decoded

    for name, side in SIDES.items():
        images = decode_split(first, name, side, 3)
        assert len(images) == first.size(name)
        for i in (0, len(images) - 1):  # the pixels serving computes from the file's bytes
            assert np.array_equal(images[i], load_resized(folder / images.paths[i], side, 3))

    assert _split(folder, home)[1] == 0  # a scheduled retrain on the same files
    write_filename_layout(folder, {"cat": 6, "dog": 4}, size=40, start=40)
    grown, decoded = _split(folder, home)
    assert decoded == 10 and grown.manifest != first.manifest
    assert _training_decodes(grown) == 0

    photo("dog", 999, 40).save(folder / "cat.3.jpg")  # same name, new content
    changed, decoded = _split(folder, home)
    assert decoded == 1
    split_of = {p: s for p, _, s in read_manifest(changed.manifest)}
    images = decode_split(changed, split_of["cat.3.jpg"], SIDES[split_of["cat.3.jpg"]], 3)
    row = images.paths.index("cat.3.jpg")
    assert np.array_equal(images[row], load_resized(folder / "cat.3.jpg", images[row].shape[1], 3))


def test_another_image_size_decodes_again_and_old_sizes_are_pruned(tmp_path, home):
    folder = tmp_path / "d"
    write_filename_layout(folder, {"cat": 20, "dog": 20}, size=40)
    for size in (10, 11, 12, 13, 14):
        result, decoded = _split(folder, home, {"train": size, "val": size, "test": size})
        assert decoded == 40
    stores = sorted(p.name for p in (result.manifest.parent.parent / "decoded").iterdir())
    assert stores == ["11px", "12px", "13px", "14px"]  # the four most recently used
    assert _training_decodes(result, {"train": 14, "val": 14, "test": 14}) == 0
    assert _training_decodes(result, {"train": 10}) == result.size("train")  # a pruned size


def test_rows_of_deleted_files_are_reclaimed(tmp_path, home):
    folder = tmp_path / "d"
    write_filename_layout(folder, {"cat": 30, "dog": 30}, size=40)
    sides = {"train": 12, "val": 12, "test": 12}
    result, _ = _split(folder, home, sides)
    store = result.manifest.parent.parent / "decoded" / "12px"
    (data,) = store.glob("images-*.u8")
    assert data.stat().st_size == 60 * 3 * 12 * 12
    for path in [*sorted(folder.glob("cat.*"))[:20], *sorted(folder.glob("dog.*"))[:20]]:
        path.unlink()
    smaller, decoded = _split(folder, home, sides)
    assert decoded == 0
    (data,) = store.glob("images-*.u8")
    assert data.stat().st_size == 20 * 3 * 12 * 12
    assert json.loads((store / "index.json").read_text())["rows"] == 20
    for name in ("train", "val", "test"):
        images = decode_split(smaller, name, 12, 3)
        assert np.array_equal(images[0], load_resized(folder / images.paths[0], 12, 3))


def test_grayscale_images_are_read_with_one_channel(tmp_path, home):
    folder = tmp_path / "d"
    write_filename_layout(folder, {"cat": 20, "dog": 20}, size=40)
    for path in folder.glob("*.jpg"):
        Image.open(path).convert("L").save(path)
    result, _ = _split(folder, home)
    assert result.channels == 1
    images = decode_split(result, "train", SIDES["train"], 1)
    assert images[0].shape == (1, 14, 14)
    assert np.array_equal(images[0], load_resized(folder / images.paths[0], 14, 1))


def test_a_file_moved_to_another_split_by_a_bad_file_is_decoded_at_its_side(tmp_path, home):
    """Each image is decoded at the side of the split it was hoped to be in; a bad file
    changes the assignment of the files after it, which must still be found by training."""
    folder = tmp_path / "d"
    write_filename_layout(folder, {"cat": 40, "dog": 40}, size=40)
    clean, _ = _split(folder, tmp_path / "elsewhere")
    test_cat = next(p for p, label, s in read_manifest(clean.manifest)
                    if label == "cat" and s == "test")
    (folder / test_cat).write_bytes((folder / test_cat).read_bytes()[:200])
    result, decoded = _split(folder, home)
    assert result.quarantined == 1
    assert decoded > 80  # the ones the bad file moved were decoded again, at their new side
    assert _training_decodes(result) == 0


def test_a_large_pass_decodes_in_worker_processes(tmp_path, home, monkeypatch):
    monkeypatch.setattr(decode_pass, "IN_PROCESS_BELOW", 0)
    folder = tmp_path / "d"
    write_filename_layout(folder, {"cat": 30, "dog": 30}, size=40)
    (folder / "dog.0.jpg").write_bytes(b"not a jpeg")
    sides = {"train": 14, "val": 14, "test": 14}  # one side: the bad file moves nothing
    result, decoded = _split(folder, home, sides)
    assert decoded == 60 and result.quarantined == 1
    assert _training_decodes(result, sides) == 0
    images = decode_split(result, "train", 14, 3)
    assert np.array_equal(images[5], load_resized(folder / images.paths[5], 14, 3))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounts a tmpfs")
def test_a_full_disk_is_named_before_decoding(tmp_path):
    home = tmp_path / "small"
    home.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(home)], check=True)
    try:
        folder = tmp_path / "d"
        write_filename_layout(folder, {"cat": 20, "dog": 20}, size=40)
        big = {"train": 200, "val": 200, "test": 200}  # 40 rows of 120 kB: 4.8 MB
        with pytest.raises(OSError, match=r"40 images at 200 px needs 5 MB in .* MB free\): free"):
            _split(folder, home, big)
        assert not list(home.glob("splits/*/ledger.json"))  # nothing half-made was recorded
        result, decoded = _split(folder, home, SIDES)  # what fits still works afterwards
        assert decoded == 40 and result.size("train") > 0
    finally:
        subprocess.run(["umount", "--lazy", str(home)], check=True)


ONE_SPLIT = r"""
import sys, time
from pathlib import Path
from tests.test_decode_store import _split
folder, home, seed, start = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
time.sleep(max(0.0, start - time.time()))  # both processes begin at the same instant
result, decoded = _split(folder, home, {"train": 12, "val": 12, "test": 12}, seed=seed)
print(decoded, result.manifest)
"""


def test_two_runs_splitting_one_dataset_at_once_decode_each_image_once(tmp_path, home):
    """Two flow runs of one deployment starting together: one decodes, the other waits for
    the store's lock and finds every image there, never a half-written store."""
    import sys
    import time

    folder = tmp_path / "d"
    write_filename_layout(folder, {"cat": 60, "dog": 60}, size=40)
    start = time.time() + 8  # after both interpreters have imported torch
    procs = [subprocess.Popen([sys.executable, "-c", ONE_SPLIT, str(folder), str(home), str(seed),
                               str(start)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "TRAINFLOW_HOME": str(home)})
             for seed in (1, 1)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outputs]
    decoded = [int(out.split()[0]) for out, _ in outputs]
    assert sorted(decoded) == [0, 120]  # one decoded everything; the other, nothing
    assert len({out.split()[1] for out, _ in outputs}) == 1  # the same split
    result, again = _split(folder, home, {"train": 12, "val": 12, "test": 12}, seed=1)
    assert again == 0
    for name in ("train", "val", "test"):  # every row is its file's pixels: nothing half-written
        images = decode_split(result, name, 12, 3)
        for i in range(len(images)):
            assert np.array_equal(images[i], load_resized(folder / images.paths[i], 12, 3))
