"""Several first runs on a fresh home at the same instant (a deploy, a schedule boundary):
one writes each shared thing, the others wait and reuse it, and nothing is read half-written."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from tests.test_kaggle import SLUG, kaggle  # noqa: F401 (the stand-in, as a fixture)

pytestmark = pytest.mark.slow


ROUNDS = 10


def _prepare_and_split(homes: list[str], dataset: dict, start, out) -> None:
    """One first run per home, each leaving the barrier with the two others at once."""
    from pathlib import Path

    from training.config import DatasetSpec, SplitSpec
    from training.data.sources import prepare
    from training.data.split import split_dataset

    for round_, home in enumerate(homes):
        start.wait(timeout=120)
        try:
            ref = prepare(DatasetSpec(**dataset), Path(home))
            split = split_dataset(ref, SplitSpec(), Path(home),
                                  {"train": 10, "val": 8, "test": 8})
            out.put(json.dumps({"round": round_, "fingerprint": ref.fingerprint,
                                "manifest": split.manifest_sha256, "images": ref.image_count}))
        except BaseException as e:
            out.put(json.dumps({"round": round_, "error": f"{type(e).__name__}: {e}"}))


def _three_at_once(root, dataset: dict, rounds: int = ROUNDS) -> list[Path]:
    """`rounds` fresh homes under `root`, each prepared and split by 3 processes at the same
    instant: every process succeeds, all agree, and each image is decoded once."""
    homes = [root / f"home{n}" for n in range(rounds)]
    context = multiprocessing.get_context("spawn")
    start, out = context.Barrier(3), context.Queue()
    runs = [context.Process(target=_prepare_and_split,
                            args=([str(h) for h in homes], dataset, start, out))
            for _ in range(3)]
    for run in runs:
        run.start()
    results = [json.loads(out.get(timeout=600)) for _ in range(3 * rounds)]
    for run in runs:
        run.join(timeout=60)
    assert [r for r in results if "error" in r] == []
    for round_, home in enumerate(homes):
        mine = [r for r in results if r["round"] == round_]
        assert len(mine) == 3
        assert len({(r["fingerprint"], r["manifest"], r["images"]) for r in mine}) == 1, home
        # Each image decoded once: the stores hold one row per file, none written twice.
        indexes = list(home.glob("splits/*/decoded/*/index.json"))
        assert indexes, f"no decode store in {home}"
        for index in indexes:
            stored = json.loads(index.read_text())
            assert stored["rows"] == len(stored["files"]), index.parent.name
    assert len({r["fingerprint"] for r in results}) == 1  # the same data every round
    return homes


def _staging_left(home: Path) -> list[str]:
    """Hidden staging folders or files left in the home's datasets (locks aside)."""
    return [str(p) for p in (home / "datasets").rglob(".*") if not p.name.endswith(".lock")]


def test_three_first_runs_prepare_and_split_the_builtin_digits_at_once(tmp_path):
    for home in _three_at_once(tmp_path, {"source": "builtin:digits"}):
        copies = [p for p in (home / "datasets" / "builtin").iterdir()
                  if not p.name.endswith(".lock")]
        assert [p.name for p in copies] == ["digits"]  # one copy, no staging folder left
        assert len(list((home / "datasets" / "builtin" / "digits").rglob("*.png"))) == 1797


def test_three_first_runs_read_a_torchvision_dataset_into_tables_at_once(tmp_path):
    from tests.formats import write_mnist

    write_mnist(tmp_path / "tv", train=200, test=50)
    for home in _three_at_once(tmp_path, {"source": "torchvision:MNIST",
                                          "root": str(tmp_path / "tv")}):
        assert _staging_left(home) == []


def test_three_first_runs_read_a_hugging_face_dataset_into_tables_at_once(tmp_path):
    from tests.formats import write_hf_parquet

    write_hf_parquet(tmp_path / "hub", {"train": 24, "test": 8}, names=["flat", "round"])
    for home in _three_at_once(tmp_path, {"source": f"hf:{tmp_path / 'hub'}"}):
        assert _staging_left(home) == []


def test_three_first_runs_split_one_folder_at_once(tmp_path):
    from tests.imagegen import write_folder_layout

    write_folder_layout(tmp_path / "pets", {"cat": 30, "dog": 30})
    _three_at_once(tmp_path, {"source": str(tmp_path / "pets")})


def test_three_first_runs_download_one_kaggle_competition_once(kaggle, tmp_path):  # noqa: F811
    """Through the real `kaggle` client and the loopback stand-in: one download per home."""
    _three_at_once(tmp_path, {"source": f"kaggle:competitions/{SLUG}", "labels": "filename",
                              "subdir": "train"})
    assert kaggle.downloads == ROUNDS
