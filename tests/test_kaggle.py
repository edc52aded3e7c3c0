"""The Kaggle path through the real `kaggle` client against a loopback stand-in of the API."""

import logging
import zipfile
from io import BytesIO

import pytest

from tests.imagegen import dogs_vs_cats_zip
from tests.kaggle_standin import KaggleStandIn
from training.config import DatasetSpec
from training.data.labels import DatasetError
from training.data.sources import prepare

USER, KEY = "tester", "KGL-SECRET-4c1d2e9f"
SLUG = "dogs-vs-cats-redux-kernels-edition"


@pytest.fixture
def kaggle(monkeypatch, tmp_path):
    monkeypatch.setenv("KAGGLE_API_ENVIRONMENT", "TEST")
    monkeypatch.setenv("KAGGLE_USERNAME", USER)
    monkeypatch.setenv("KAGGLE_KEY", KEY)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))  # no real ~/.kaggle
    with KaggleStandIn(USER, KEY) as server:
        server.archives[f"competitions/{SLUG}"] = dogs_vs_cats_zip({"cat": 12, "dog": 10})
        yield server


def _spec(**fields):
    return DatasetSpec(**{"source": f"kaggle:competitions/{SLUG}", "labels": "filename",
                          "subdir": "train", **fields})


def test_download_once_then_cache(kaggle, home, caplog):
    caplog.set_level(logging.DEBUG)
    ref = prepare(_spec(), home)
    assert ref.class_counts == {"cat": 12, "dog": 10}
    assert kaggle.downloads == 1
    assert kaggle.requests[0][1] == "/api/v1/competitions.CompetitionApiService/ListDataFiles"
    assert kaggle.requests[1][1] == (
        "/api/v1/competitions.CompetitionApiService/DownloadDataFiles")
    again = prepare(_spec(), home)
    assert again.fingerprint == ref.fingerprint
    # The version is asked again (one listing); the unchanged version is not downloaded again.
    assert kaggle.downloads == 1 and len(kaggle.requests) == 4
    assert kaggle.requests[3][1].endswith("/ListDataFiles")
    assert KEY not in caplog.text


def test_a_new_version_is_downloaded_beside_the_old(kaggle, home):
    first = prepare(_spec(), home)
    kaggle.archives[f"competitions/{SLUG}"] = dogs_vs_cats_zip({"cat": 15, "dog": 14})
    second = prepare(_spec(), home)
    assert kaggle.downloads == 2
    assert second.class_counts == {"cat": 15, "dog": 14}
    assert second.fingerprint != first.fingerprint
    assert first.root.is_dir() and first.root != second.root  # the old copy stays


def test_kaggle_unreachable_uses_the_newest_copy_or_says_why(kaggle, home):
    messages = []
    ref = prepare(_spec(), home)
    kaggle.__exit__()
    offline = prepare(_spec(), home, warn=messages.append)
    assert offline.fingerprint == ref.fingerprint and offline.root == ref.root
    assert len(messages) == 1 and "using the newest complete copy" in messages[0]
    assert messages[0].startswith("cannot ask Kaggle for the current version")
    with pytest.raises(DatasetError, match="cannot reach Kaggle.*no complete copy"):
        prepare(DatasetSpec(source="kaggle:competitions/other-slug"), home)


def test_a_pinned_dataset_version(kaggle, home):
    kaggle.archives["datasets/someone/pets"] = dogs_vs_cats_zip({"cat": 3, "dog": 3})
    kaggle.archives["datasets/someone/pets@v1"] = dogs_vs_cats_zip({"cat": 2, "dog": 2})
    spec = DatasetSpec(source="kaggle:datasets/someone/pets", labels="filename", subdir="train",
                       version=1)
    assert prepare(spec, home).image_count == 4
    with pytest.raises(ValueError, match="pins a Kaggle dataset's version"):
        _spec(version=2)


def test_dataset_source(kaggle, home):
    kaggle.archives["datasets/someone/pets"] = dogs_vs_cats_zip({"cat": 3, "dog": 3})
    ref = prepare(DatasetSpec(source="kaggle:datasets/someone/pets", labels="filename",
                              subdir="train"), home)
    assert ref.image_count == 6


def test_interrupted_download_is_not_taken_as_complete(kaggle, home):
    archive = kaggle.archives[f"competitions/{SLUG}"]
    kaggle.cut_after = len(archive) // 2
    with pytest.raises(DatasetError, match="did not complete.*nothing was kept"):
        prepare(_spec(download_retries=0), home)
    cache = home / "datasets" / "kaggle" / "competitions"
    assert not any(p.suffix == ".zip" for p in cache.rglob("*"))
    assert not any((cache / SLUG).rglob("*.jpg")) and not list(cache.rglob(".complete"))
    kaggle.cut_after = None
    assert prepare(_spec(), home).image_count == 22
    assert kaggle.downloads == 2


def test_archive_with_traversal_is_refused(kaggle, home, tmp_path):
    buf = BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("train/cat.0.jpg", b"x")
        zf.writestr("../../../escaped.txt", b"pwned")
    kaggle.archives[f"competitions/{SLUG}"] = buf.getvalue()
    with pytest.raises(ValueError, match="outside the target folder"):
        prepare(_spec(), home)
    assert not list(tmp_path.rglob("escaped.txt"))
    assert not list((home / "datasets" / "kaggle" / "competitions").rglob("*.jpg"))


def test_wrong_key_is_401(kaggle, home, monkeypatch, caplog):
    monkeypatch.setenv("KAGGLE_KEY", "wrong-key")
    with pytest.raises(DatasetError, match=r"rejected the credentials \(401\).*KAGGLE_USERNAME"):
        prepare(_spec(), home)


def test_unaccepted_rules_are_403(kaggle, home):
    kaggle.forbidden.add(f"competitions/{SLUG}")
    with pytest.raises(DatasetError, match=f"accept the competition rules on .*{SLUG}/rules"):
        prepare(_spec(), home)


def test_unknown_slug_is_404(kaggle, home):
    with pytest.raises(DatasetError, match="no competition 'no-such-thing' \\(404\\)"):
        prepare(DatasetSpec(source="kaggle:competitions/no-such-thing"), home)


def test_missing_credentials_say_where_to_put_them(kaggle, home, monkeypatch):
    monkeypatch.delenv("KAGGLE_USERNAME")
    monkeypatch.delenv("KAGGLE_KEY")
    with pytest.raises(DatasetError, match="KAGGLE_USERNAME and KAGGLE_KEY.*kaggle.json"):
        prepare(_spec(), home)
    assert kaggle.requests == []  # failed before any network call


def test_kaggle_json_is_read(kaggle, home, monkeypatch, tmp_path):
    monkeypatch.delenv("KAGGLE_USERNAME")
    monkeypatch.delenv("KAGGLE_KEY")
    config = tmp_path / "user" / ".kaggle"
    config.mkdir(parents=True)
    (config / "kaggle.json").write_text(f'{{"username": "{USER}", "key": "{KEY}"}}')
    assert prepare(_spec(), home).image_count == 22


def test_credentials_from_a_prefect_secret_block(kaggle, home, monkeypatch, prefect_engine):
    import json

    from prefect.blocks.system import Secret

    from tasks.data import credentials_from_secret_block

    monkeypatch.delenv("KAGGLE_USERNAME")
    monkeypatch.delenv("KAGGLE_KEY")
    Secret(value=json.dumps({"username": USER, "key": KEY})).save("kaggle-test", overwrite=True)
    monkeypatch.setenv("KAGGLE_SECRET_BLOCK", "kaggle-test")
    credentials = credentials_from_secret_block()
    assert KEY not in repr(credentials)
    assert prepare(_spec(), home, credentials).image_count == 22


@pytest.mark.slow
def test_the_next_run_trains_on_a_new_version_and_skips_an_unchanged_one(kaggle, home,
                                                                         prefect_engine):
    """What a weekly scheduled run sees: the same version -> skipped; a new one -> trained, and
    judged against the champion on the new test images."""
    from flows.train_flow import train_flow

    kaggle.archives[f"competitions/{SLUG}"] = dogs_vs_cats_zip({"cat": 30, "dog": 30})
    params = {"dataset": _spec().model_dump(), "split": {"test_fraction": 0.3},
              # Enough learning that v1 clearly beats chance on 18 test images (it must be
              # promoted for v2 to face it).
              "training": {"epochs": 3, "lr": 0.003, "image_size": 16, "batch_size": 16,
                           "num_processes": 1},
              "registry": {"model_name": "kaggle-weekly"}}
    first = train_flow(**params)
    assert first.registration.version == "1"
    assert train_flow(**params).skipped  # nothing new on Kaggle
    kaggle.archives[f"competitions/{SLUG}"] = dogs_vs_cats_zip({"cat": 40, "dog": 40})
    grown = train_flow(**params)
    assert kaggle.downloads == 2
    assert grown.registration.version == "2"
    assert sum(grown.trained.job.split.counts["test"].values()) == (
        grown.registration.compared_images) > sum(first.trained.job.split.counts["test"].values())
    assert grown.registration.champion_version == "1"
