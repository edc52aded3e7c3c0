"""`trainflow rerun`: the recorded commit's code in a worktree, or a refusal that says why."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tasks.lineage import FLOW_PARAMETERS, GIT_COMMIT, GIT_DIRTY, REPO

TRAINFLOW = str(Path(sys.executable).parent / "trainflow")
PARAMS = {"dataset": {"source": "builtin:digits"},
          "split": {"val_fraction": 0.1, "test_fraction": 0.1, "seed": 42},
          "training": {"epochs": 1, "image_size": 12, "batch_size": 50, "num_processes": 1,
                       "main_process_port": 29999},
          "registry": {"model_name": "rerun-digits"}}


def _version(client: MlflowClient, tags: dict) -> str:
    """A registered version carrying only the lineage tags rerun reads."""
    with contextlib.suppress(Exception):
        client.create_registered_model("rerun-digits")
    run = client.create_run(client.create_experiment(f"rerun-{len(tags)}-{os.urandom(3).hex()}"))
    return str(client.create_model_version("rerun-digits", "runs:/x/model", run.info.run_id,
                                       tags={FLOW_PARAMETERS: json.dumps(PARAMS), **tags}).version)


def _rerun(uri: str, version: str, env: dict | None = None):
    return subprocess.run([TRAINFLOW, "rerun", "rerun-digits", version], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "MLFLOW_TRACKING_URI": uri, **(env or {})})


@pytest.mark.parametrize("tags, message", [
    ({GIT_COMMIT: "unknown", GIT_DIRTY: "false"}, "records no git commit"),
    ({GIT_COMMIT: "0" * 40, GIT_DIRTY: "false"}, "is not in this clone"),
    ({GIT_COMMIT: "HEAD", GIT_DIRTY: "true"}, "trained from uncommitted changes"),
])
def test_rerun_refuses_what_cannot_be_reproduced(tmp_path, tags, message):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    version = _version(MlflowClient(uri), tags)
    done = _rerun(uri, version)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_rerun_trains_the_recorded_commit_in_a_worktree(prefect_engine, tmp_path):
    from prefect.settings import PREFECT_API_URL

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    version = _version(client, {GIT_COMMIT: head, GIT_DIRTY: "false"})
    home = tmp_path / "home"
    try:
        done = _rerun(uri, version, {"TRAINFLOW_HOME": str(home),
                                     "PREFECT_API_URL": PREFECT_API_URL.value()})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        folder = home / "rerun" / head[:12]
        assert f"at commit {head[:12]} in {folder}" in done.stderr
        [new] = [v for v in client.search_model_versions("name='rerun-digits'")
                 if str(v.version) != version]
        assert new.tags[GIT_COMMIT] == head  # the worktree's own commit, clean
        assert new.tags[GIT_DIRTY] == "false"
        replayed = json.loads(new.tags[FLOW_PARAMETERS])["training"]
        assert replayed["epochs"] == 1 and replayed["main_process_port"] is None  # not replayed
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(home / "rerun" / head[:12])],
                       cwd=REPO, capture_output=True)
