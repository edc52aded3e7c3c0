"""Shared fixtures: an isolated home per session, the real Prefect engine, digits on disk."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_SESSION_HOME = Path(tempfile.mkdtemp(prefix="trainflow-test-"))
# Set before Prefect or MLflow are imported anywhere, so nothing touches the user's real home.
os.environ["TRAINFLOW_HOME"] = str(_SESSION_HOME / "home")
os.environ["PREFECT_HOME"] = str(_SESSION_HOME / "prefect")
# Every rank the tests start can be given a fault (TRAINFLOW_FAULT): see tests/faults.py.
os.environ["TRAINFLOW_RANK_HOOKS"] = str(Path(__file__).with_name("faults.py"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.pop("MLFLOW_TRACKING_URI", None)
for name in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN", "KAGGLE_CONFIG_DIR"):
    os.environ.pop(name, None)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_SESSION_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def session_home() -> Path:
    return Path(os.environ["TRAINFLOW_HOME"])


@pytest.fixture(scope="session")
def prefect_engine():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def digits_split(session_home):
    """The built-in digits, prepared and split once for the whole session."""
    from training.config import DatasetSpec, SplitSpec
    from training.data.sources import prepare
    from training.data.split import split_dataset

    ref = prepare(DatasetSpec(source="builtin:digits"), session_home)
    return ref, split_dataset(ref, SplitSpec(), session_home)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fresh, empty home for tests that check what gets written."""
    path = tmp_path / "home"
    monkeypatch.setenv("TRAINFLOW_HOME", str(path))
    return path
