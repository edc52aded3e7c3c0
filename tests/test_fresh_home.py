"""Several first runs on a fresh home at the same instant (a deploy, a schedule boundary):
one writes each shared thing, the others wait and reuse it, and nothing is read half-written."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from tests.test_kaggle import SLUG, kaggle  # noqa: F401 (the stand-in, as a fixture)

pytestmark = pytest.mark.slow


def _prepare_and_split(home: str, dataset: dict, start, out) -> None:
    from pathlib import Path

    from training.config import DatasetSpec, SplitSpec
    from training.data.sources import prepare
    from training.data.split import split_dataset

    start.wait(timeout=60)  # every process leaves the barrier at once
    try:
        ref = prepare(DatasetSpec(**dataset), Path(home))
        split = split_dataset(ref, SplitSpec(), Path(home), {"train": 10, "val": 8, "test": 8})
        out.put(json.dumps({"fingerprint": ref.fingerprint, "manifest": split.manifest_sha256,
                            "images": ref.image_count}))
    except BaseException as e:
        out.put(json.dumps({"error": f"{type(e).__name__}: {e}"}))


def _three_at_once(home, dataset: dict) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    start, out = context.Barrier(3), context.Queue()
    runs = [context.Process(target=_prepare_and_split, args=(str(home), dataset, start, out))
            for _ in range(3)]
    for run in runs:
        run.start()
    results = [json.loads(out.get(timeout=300)) for _ in runs]
    for run in runs:
        run.join(timeout=60)
    assert [r.get("error") for r in results] == [None] * 3
    assert len({(r["fingerprint"], r["manifest"]) for r in results}) == 1
    # Each image decoded once: the stores hold one row per file, none written twice.
    for index in home.glob("splits/*/decoded/*/index.json"):
        stored = json.loads(index.read_text())
        assert stored["rows"] == len(stored["files"]), index.parent.name
    return results


@pytest.mark.parametrize("round_", range(3))
def test_three_first_runs_prepare_and_split_the_builtin_digits_at_once(tmp_path, round_):
    home = tmp_path / "home"
    results = _three_at_once(home, {"source": "builtin:digits"})
    assert results[0]["images"] == 1797
    copies = [p for p in (home / "datasets" / "builtin").iterdir() if not p.name.endswith(".lock")]
    assert [p.name for p in copies] == ["digits"]  # one copy, no staging folder left


@pytest.mark.parametrize("round_", range(3))
def test_three_first_runs_read_a_torchvision_dataset_into_tables_at_once(tmp_path, round_):
    from tests.formats import write_mnist

    write_mnist(tmp_path / "tv", train=200, test=50)
    home = tmp_path / "home"
    results = _three_at_once(home, {"source": "torchvision:MNIST", "root": str(tmp_path / "tv")})
    assert results[0]["images"] == 250
    tables = [p.name for p in (home / "datasets" / "tables").rglob("*")
              if p.name.startswith(".") and not p.name.endswith(".lock")]
    assert tables == []  # no staging folder left


def test_three_first_runs_split_one_folder_at_once(tmp_path):
    from tests.imagegen import write_folder_layout

    write_folder_layout(tmp_path / "pets", {"cat": 30, "dog": 30})
    results = _three_at_once(tmp_path / "home", {"source": str(tmp_path / "pets")})
    assert results[0]["images"] == 60


def test_three_first_runs_download_one_kaggle_competition_once(kaggle, tmp_path):  # noqa: F811
    """Through the real `kaggle` client and the loopback stand-in: one download, one copy."""
    results = _three_at_once(tmp_path / "home", {"source": f"kaggle:competitions/{SLUG}",
                                                 "labels": "filename", "subdir": "train"})
    assert results[0]["images"] == 22
    assert kaggle.downloads == 1
