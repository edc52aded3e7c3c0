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
    assert kaggle.requests[0][1] == (
        "/api/v1/competitions.CompetitionApiService/DownloadDataFiles")
    again = prepare(_spec(), home)
    assert again.fingerprint == ref.fingerprint
    assert kaggle.downloads == 1 and len(kaggle.requests) == 2  # POST + GET, once
    assert KEY not in caplog.text


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
    assert not (cache / SLUG).exists()
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
    assert not (home / "datasets" / "kaggle" / "competitions" / SLUG).exists()


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
