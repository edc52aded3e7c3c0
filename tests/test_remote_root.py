"""TRAINFLOW_REMOTE_ROOT against a real S3 server (moto's): a split's manifest and decode
stores go up once and come down once, and checkpoints are resumed only when complete."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tests.servers import BIN, started
from training.processes import free_port

pytestmark = pytest.mark.slow
KEYS = {"AWS_ACCESS_KEY_ID": "remote-test-key-id", "AWS_SECRET_ACCESS_KEY": "remote-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("s3") / "s3.log"
    with started([str(BIN / "python"), "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                 f"{url}/moto-api/", log) as server:
        import boto3

        boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                     aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"]
                     ).create_bucket(Bucket="team")
        yield url, server


@pytest.fixture
def remote(s3_server, monkeypatch, request):
    from runtime.remote import remote_root

    monkeypatch.setenv("TRAINFLOW_REMOTE_TIMEOUT_S", "2")  # a stopped server, found quickly
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server[0])
    monkeypatch.setenv("TRAINFLOW_REMOTE_ROOT", f"s3://team/{request.node.name}")
    return remote_root()


def test_a_split_goes_up_once_and_is_read_elsewhere_without_its_images(digits_split, remote,
                                                                       tmp_path):
    from runtime.remote import RemoteRootError, fetch_split, publish_split
    from training.data.cache import decode_split

    _, split = digits_split
    here = {name: decode_split(split, name, 8, 1) for name in ("train", "test")}
    published = publish_split(remote, split, [8])
    keys = remote.keys(remote.key())
    # A store is one object and its index, never an object per image; the split is its
    # manifest, ledger, quarantine list and the record naming its stores (written last).
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == sorted(
        ["manifest.csv", "ledger.json", "quarantine.json", "split.json", "images.u8",
         "index.json"]), keys
    assert publish_split(remote, split, [8]) == published
    assert remote.keys(remote.key()) == keys

    elsewhere = tmp_path / "other-home"
    fetched = fetch_split(remote, split, published, elsewhere)
    assert fetched.decoded_only and not fetched.root.exists()
    assert fetched.manifest.read_bytes() == split.manifest.read_bytes()
    for name, images in here.items():
        there = decode_split(fetched, name, 8, 1)
        assert there.paths == images.paths
        assert np.array_equal(there.labels, images.labels)
        assert np.array_equal(np.stack([there[i] for i in range(len(there))]),
                              np.stack([images[i] for i in range(len(images))]))
    data = next(elsewhere.rglob("images.u8"))
    before = data.stat().st_mtime_ns
    fetch_split(remote, split, published, elsewhere)  # the same hash is not fetched again
    assert data.stat().st_mtime_ns == before

    with pytest.raises(ValueError, match="lacks .* images of the train split"):
        decode_split(fetched, "train", 16, 1)  # a side that was not published

    # A split the bucket does not hold is named, with what to check; nothing is left behind.
    missing = published.model_copy(update={"manifest_sha256": "0" * 64})
    with pytest.raises(RemoteRootError, match="cannot be fetched from s3://.* same "
                       "TRAINFLOW_REMOTE_ROOT"):
        fetch_split(remote, split, missing, elsewhere)
    assert not list((elsewhere / "fetched" / ("0" * 64)).rglob("*.csv"))


def test_a_machine_without_the_data_stages_files_gets_them_at_the_same_paths(home, remote):
    """What a flow run retried on another machine does (tasks/data.py bring_data_here): the
    dataset version and the split come back where the stages put them, byte for byte and with
    the modification times the decode stores key their rows by, so nothing is decoded again."""
    from runtime.remote import (
        RemoteRootError,
        publish_dataset,
        publish_split,
        restore_dataset,
        restore_split,
    )
    from training.config import DatasetSpec, SplitSpec
    from training.data.cache import decode_split
    from training.data.sources import prepare
    from training.data.split import split_dataset
    from training.data.store import DecodeStore

    ref = prepare(DatasetSpec(source="builtin:digits"), home)
    split = split_dataset(ref, SplitSpec(), home, sides={"train": 8, "val": 8, "test": 8})
    assert not restore_dataset(remote, ref) and not restore_split(remote, split)  # here already
    with pytest.raises(RemoteRootError, match="neither at .* nor in s3://.* `force`"):
        restore_split(remote, split.model_copy(update={"manifest": home / "gone" / "m.csv"}))
    publish_dataset(remote, ref)
    publish_split(remote, split, [8])
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in ref.source_root.rglob("*")
             if p.is_file()}
    manifest = split.manifest.read_bytes()
    decoded_before = {name: decode_split(split, name, 8, 1) for name in ("train", "test")}

    # Another machine: the same home path, nothing in it.
    for folder in (ref.source_root, split.manifest.parent.parent):
        os.rename(folder, home / f"away-{folder.name}")
    assert restore_dataset(remote, ref) and restore_split(remote, split)
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in ref.source_root.rglob("*")
            if p.is_file()} == files
    assert split.manifest.read_bytes() == manifest
    store = DecodeStore(split.manifest.parent.parent, 8)
    with store.locked(exclusive=False) as index:
        relpaths = list(index["files"])
        assert store.pending(index, split.root, relpaths) == []  # no image to decode again
    for name, before in decoded_before.items():
        after = decode_split(split, name, 8, 1)
        assert after.paths == before.paths
        assert np.array_equal(np.stack([after[i] for i in range(len(after))]),
                              np.stack([before[i] for i in range(len(before))]))


def test_a_finished_training_and_evaluation_come_back_without_checkpoints_or_progress(
        home, remote):
    """After training and evaluation ended on one machine, another machine's retry gets their
    files (the best weights, the predictions) and keeps what it already has."""
    from runtime.remote import publish_run_outputs, restore_run_outputs

    run = home / "runs" / "1234"
    files = {"train/best.safetensors": os.urandom(3000), "train/job.json": b"{}",
             "train/checkpoints/checkpoint_1/model.safetensors": b"big",
             "train/progress/rank0.jsonl": b"{}", "evaluation/predictions.csv": b"path,label",
             "evaluation/progress/rank0.jsonl": b"{}"}
    for name, body in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(body)
    publish_run_outputs(remote, run / "train")
    assert restore_run_outputs(remote, run) == ["train"]  # no evaluation published yet
    publish_run_outputs(remote, run / "evaluation")
    os.rename(run, home / "away")

    (run / "evaluation").mkdir(parents=True)
    (run / "evaluation" / "predictions.csv").write_bytes(b"this machine's own")
    assert restore_run_outputs(remote, run) == ["train", "evaluation"]
    here = {p.relative_to(run).as_posix(): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert here == {"train/best.safetensors": files["train/best.safetensors"],
                    "train/job.json": b"{}", "evaluation/predictions.csv": b"this machine's own"}


def test_a_machine_keeps_the_newest_fetched_splits_only(tmp_path):
    from runtime.remote import KEPT_FETCHED, prune_fetched

    folders = []
    for i in range(KEPT_FETCHED + 2):
        folder = tmp_path / "fetched" / f"{i:064d}"
        (folder / "manifest").mkdir(parents=True)
        os.utime(folder, (1000 + i, 1000 + i))
        folders.append(folder)
    assert prune_fetched(tmp_path) == [folders[1], folders[0]]
    assert sorted(p for p in (tmp_path / "fetched").iterdir() if p.is_dir()) == folders[2:]


# Large enough that its upload (about 1.5 s through moto) outlasts the few milliseconds between
# its first object appearing and the cut, however fast the machine.
CUT_SIZE = 256 * 2**20


def _checkpoint(folder: Path, number: int, size: int = 1000) -> Path:
    path = folder / f"checkpoint_{number}"
    path.mkdir(parents=True)
    (path / "a-small.json").write_text(f'{{"epoch": {number}}}')
    (path / "model.safetensors").write_bytes(os.urandom(size))
    (path / "trainer_state.json").write_text(f'{{"epoch": {number}}}')
    return path


UPLOAD_ONE = """
import logging, sys
from pathlib import Path
from runtime.remote import CheckpointUploader, remote_root
CheckpointUploader(remote_root(), Path(sys.argv[1]), sys.argv[2], logging.getLogger()).sweep()
"""


def test_checkpoints_go_up_marker_last_and_a_cut_upload_is_never_resumed(remote, tmp_path):
    import logging

    from runtime.remote import CheckpointUploader, fetch_checkpoints, remote_checkpoints

    local, prefix = tmp_path / "machine-0" / "checkpoints", "runs/r1/train/checkpoints"
    uploader = CheckpointUploader(remote, local, prefix, logging.getLogger("t"))
    for number in (1, 2, 3):
        _checkpoint(local, number)
        uploader.sweep()
    assert sorted(remote_checkpoints(remote, prefix)) == [2, 3]  # the newest two are kept

    # The machine doing the upload dies half-way through checkpoint 4's weights (64 MB).
    _checkpoint(local, 4, size=CUT_SIZE)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(UPLOAD_ONE), str(local),
                             prefix], env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    first = remote.key(prefix, "checkpoint_4", "a-small.json")
    deadline = time.monotonic() + 60
    while not remote.exists(first) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert remote.exists(first), "the upload never started"
    assert not remote.exists(remote.key(prefix, "checkpoint_4", "trainer_state.json"))
    assert sorted(remote_checkpoints(remote, prefix)) == [2, 3]

    # Another machine resumes from the newest complete one, whole; the cut one is not there.
    other = tmp_path / "machine-1" / "checkpoints"
    assert fetch_checkpoints(remote, prefix, other) == [2, 3]
    assert sorted(p.name for p in other.iterdir()) == ["checkpoint_2", "checkpoint_3"]
    assert ((other / "checkpoint_3" / "model.safetensors").read_bytes()
            == (local / "checkpoint_3" / "model.safetensors").read_bytes())
    assert fetch_checkpoints(remote, prefix, other) == []  # nothing newer: nothing fetched


def test_a_checkpoint_upload_cut_by_the_s3_server_stopping_is_never_resumed(s3_server, remote,
                                                                          tmp_path):
    """The S3 server is stopped (SIGSTOP) while checkpoint 3 goes up, until the upload gives
    up, then goes on: 3 is not complete there, so 2 is what a resume fetches; the next look
    uploads 3 whole."""
    import logging
    import threading

    from runtime.remote import CheckpointUploader, fetch_checkpoints, remote_checkpoints

    server = s3_server[1]
    local, prefix = tmp_path / "machine-0" / "checkpoints", "runs/r2/train/checkpoints"
    uploader = CheckpointUploader(remote, local, prefix, logging.getLogger("t"))
    for number in (1, 2):
        _checkpoint(local, number)
        assert uploader.sweep()
    _checkpoint(local, 3, size=CUT_SIZE)
    outcome = []
    upload = threading.Thread(target=lambda: outcome.append(uploader.sweep()))
    upload.start()
    first = remote.key(prefix, "checkpoint_3", "a-small.json")
    deadline = time.monotonic() + 60
    while not remote.exists(first) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(server.pid, signal.SIGSTOP)
    try:
        upload.join(120)
    finally:
        os.killpg(server.pid, signal.SIGCONT)
    assert outcome == [False]  # told, and not marked uploaded
    assert remote.exists(first), "the upload was not under way when the server stopped"
    assert sorted(remote_checkpoints(remote, prefix)) == [1, 2]
    assert fetch_checkpoints(remote, prefix, tmp_path / "machine-1") == [1, 2]
    assert uploader.sweep()
    assert sorted(remote_checkpoints(remote, prefix)) == [2, 3]
