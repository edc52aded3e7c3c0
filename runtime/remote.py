"""The object store that stands in for a shared TRAINFLOW_HOME between machines.

    TRAINFLOW_REMOTE_ROOT=s3://bucket/prefix

Under the root:

    datasets/<fingerprint>.tar                       a dataset version's folder, mtimes kept
    splits/<manifest sha256>/manifest.csv            a split's manifest
    splits/<manifest sha256>/split.json              its stores (RemoteSplit), ledger beside it
    stores/<index sha256>/images.u8, index.json      a decode store, one large object; index last
    <run folder>/checkpoints/checkpoint_<n>/...      machine 0's checkpoints; trainer_state.json last
    results/<cache key>                              Prefect's results of the resumable stages

Everything a machine reads is content-addressed or marked complete by the object written last,
so a half-written upload is never read. Endpoint and credentials are boto3's own
(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL_S3), or TRAINFLOW_S3_SECRET_BLOCK.
Transfers use boto3's transfer manager (multipart, several threads), not hand-written HTTP.
Only Prefect-side processes use it: training ranks hold no credentials.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import os
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pydantic import BaseModel

from runtime.credentials import use_secret_blocks
from trainflow_serving.images import Geometry, as_geometry
from training.data.sources import DatasetRef
from training.data.store import DecodeStore
from training.engine.checkpoint_files import KEEP_CHECKPOINTS, STATE_FILE, checkpoint_number
from training.handoff import SplitResult, TrainJob
from training.storage import file_lock, home

REMOTE_ROOT = "TRAINFLOW_REMOTE_ROOT"
TIMEOUT = "TRAINFLOW_REMOTE_TIMEOUT_S"
"""How long one request to the store may wait for an answer (30 s; it is tried 3 times)."""
FETCHED = "fetched"
"""The home's folder of local copies: fetched/<manifest sha256>/ is a split folder."""
STORE_DATA = "images.u8"
SPLIT_RECORD = "split.json"
LEDGER = "ledger.json"
QUARANTINE = "quarantine.json"
AUDIT = "audit.json"
MTIMES = ".trainflow-mtimes.json"
"""In a dataset archive: each file's modification time to the nanosecond (tar keeps less), which
the decode stores key their rows by."""
RESULTS = "results"
KEPT_FETCHED = 4
"""Fetched splits a machine keeps: a new dataset version is a new split, its old copy unused."""
POLL_S = 1.0


class RemoteSplit(BaseModel):
    """Where a split's manifest and decode stores are in the remote root: a node's parameter."""

    manifest_sha256: str
    stores: dict[str, str]
    """geometry name (e.g. "64px") -> the store's index sha256"""


@dataclass(frozen=True)
class RemoteRoot:
    bucket: str
    prefix: str
    client: Any = field(compare=False, repr=False)

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p.strip("/"))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix.rstrip("/") + "/")
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def upload(self, path: Path, key: str, size: int | None = None) -> None:
        """A file (or its first `size` bytes) to `key`, multipart when large."""
        with open(path, "rb") as f:
            body = f if size is None else _Prefix(f, size)
            self.client.upload_fileobj(body, self.bucket, key)

    def put(self, data: bytes, key: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def download(self, key: str, path: Path) -> None:
        """To `path` through a temporary name: a cut download leaves no file under `path`."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.part")
        self.client.download_file(self.bucket, key, str(tmp))
        os.replace(tmp, path)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for at in range(0, len(keys), 1000):  # S3's most per request
            self.client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": key} for key in keys[at:at + 1000]], "Quiet": True})


class _Prefix:
    """The first `size` bytes of a file: a store's data file may hold reserved rows past the
    index's count, which are not part of the store."""

    def __init__(self, f, size: int):
        self.f, self.left = f, size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data


class RemoteRootError(ValueError):
    pass


def remote_root() -> RemoteRoot | None:
    """The remote root from TRAINFLOW_REMOTE_ROOT, or None when machines share the home."""
    url = os.environ.get(REMOTE_ROOT, "").strip()
    if not url:
        return None
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise RemoteRootError(f"{REMOTE_ROOT}={url!r} is not an s3://bucket/prefix URL; set it "
                              "to one, or unset it to use a shared TRAINFLOW_HOME")
    use_secret_blocks()
    import boto3
    from botocore.config import Config

    timeout = float(os.environ.get(TIMEOUT, "30"))
    client = boto3.client("s3", config=Config(retries={"max_attempts": 3, "mode": "standard"},
                                              connect_timeout=timeout, read_timeout=timeout))
    return RemoteRoot(parsed.netloc, parsed.path.strip("/"), client)


def check_remote_root(remote: RemoteRoot) -> None:
    """The bucket answers and takes these credentials: before any upload or launch."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        remote.client.list_objects_v2(Bucket=remote.bucket, Prefix=remote.key("splits") + "/",
                                      MaxKeys=1)
    except (ClientError, BotoCoreError) as e:
        raise RemoteRootError(f"{REMOTE_ROOT} {remote}: the bucket cannot be listed ({e}); "
                              "check the bucket, AWS_ENDPOINT_URL_S3 and the S3 credentials "
                              "(AWS_* variables or TRAINFLOW_S3_SECRET_BLOCK)") from None


# --- splits and their decode stores ----------------------------------------------------------

def publish_split(remote: RemoteRoot, split: SplitResult,
                  geometries: Iterable[Geometry | int]) -> RemoteSplit:
    """Upload the manifest and each store once; a store already there (same index) is skipped."""
    manifest_key = remote.key("splits", split.manifest_sha256, "manifest.csv")
    if not remote.exists(manifest_key):
        remote.upload(split.manifest, manifest_key)
    stores = {}
    for geometry in sorted({as_geometry(g) for g in geometries}):
        store = DecodeStore(split.manifest.parent.parent, geometry)
        # Under the read lock: rows below the index's count never change, and compaction waits.
        with store.locked(exclusive=False) as index:
            if not index["rows"]:
                raise RemoteRootError(f"the {geometry.name} decode store of {split.manifest} is "
                                      "empty: the split stage decodes it before training")
            body = json.dumps({**index, "data": STORE_DATA}, sort_keys=True).encode()
            sha = hashlib.sha256(body).hexdigest()
            if not remote.exists(remote.key("stores", sha, "index.json")):
                remote.upload(store.folder / index["data"], remote.key("stores", sha, STORE_DATA),
                              size=index["rows"] * store.row_bytes)
                remote.put(body, remote.key("stores", sha, "index.json"))  # last: complete
        stores[geometry.name] = sha
    published = RemoteSplit(manifest_sha256=split.manifest_sha256, stores=stores)
    record = published.model_dump_json().encode()
    record_key = remote.key("splits", split.manifest_sha256, SPLIT_RECORD)
    if remote.exists(record_key) and remote.client.get_object(
            Bucket=remote.bucket, Key=record_key)["Body"].read() == record:
        return published  # the split stage published it; the train task finds it there
    folder = split.manifest.parent.parent
    for path in (folder / LEDGER, split.manifest.parent / QUARANTINE,
                 split.manifest.parent / AUDIT):
        if path.exists():
            remote.upload(path, remote.key("splits", split.manifest_sha256, path.name))
    remote.put(record, record_key)  # last: a machine that finds it finds everything it names
    return published


def fetch_split(remote: RemoteRoot, split: SplitResult, published: RemoteSplit, home: Path,
                ) -> SplitResult:
    """The split on this machine's disk: its manifest and stores, fetched once per hash and
    kept. The result reads decoded rows only (`decoded_only`): the images are not here."""
    from botocore.exceptions import BotoCoreError, ClientError

    folder = home / FETCHED / published.manifest_sha256
    with file_lock(folder.parent / f".{folder.name}.lock"):  # two launches on one machine
        try:
            _fetch_split(remote, published, folder)
        except (ClientError, BotoCoreError) as e:
            raise RemoteRootError(
                f"the split {published.manifest_sha256[:12]} cannot be fetched from {remote} "
                f"({e}): this machine must reach the bucket the flow's machine published it "
                "to (the same TRAINFLOW_REMOTE_ROOT, AWS_ENDPOINT_URL_S3 and S3 keys)") from None
        os.utime(folder)  # used now: the least recently used copies go first
    prune_fetched(home)
    return split.model_copy(update={"manifest": folder / "manifest" / "manifest.csv",
                                    "root": folder / "images-not-here", "decoded_only": True})


def prune_fetched(home: Path, kept: int = KEPT_FETCHED) -> list[Path]:
    """Remove all but the `kept` most recently used fetched splits (a training that still maps
    a removed store keeps reading it: its files go when it ends)."""
    folders = sorted((p for p in (home / FETCHED).iterdir() if p.is_dir()),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for old in folders[kept:]:
        with file_lock(old.parent / f".{old.name}.lock"):
            shutil.rmtree(old, ignore_errors=True)
    return folders[kept:]


def _fetch_split(remote: RemoteRoot, published: RemoteSplit, folder: Path) -> None:
    manifest = folder / "manifest" / "manifest.csv"
    if not manifest.exists():
        remote.download(remote.key("splits", published.manifest_sha256, "manifest.csv"),
                        manifest)
    for name, sha in published.stores.items():
        store = DecodeStore(folder, Geometry.parse(name))
        marker = store.folder / "fetched.sha256"
        if marker.exists() and marker.read_text() == sha:
            continue
        _download_store(remote, sha, store)
        marker.write_text(sha)


def _download_store(remote: RemoteRoot, sha: str, store: DecodeStore) -> None:
    remote.download(remote.key("stores", sha, STORE_DATA), store.folder / STORE_DATA)
    remote.download(remote.key("stores", sha, "index.json"), store.index_path)  # last


# --- a flow run retried on another machine ---------------------------------------------------

def result_storage() -> str | None:
    """The Prefect block (`s3-bucket/<name>`) that holds the flow's results under the remote
    root's `results/`, so that a flow run retried on another machine skips its finished
    stages; None without a remote root. Prefect loads it when a run starts:
    `save_result_storage` (a pull step of every deployment in prefect.yaml, and `trainflow
    train`) saves it first."""
    url = os.environ.get(REMOTE_ROOT, "").strip()
    if not url:
        return None
    return f"s3-bucket/trainflow-results-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def bucket_results() -> dict:
    """train-flow's result options with a remote root: its stages' results as JSON in the
    bucket, never pickled; none without one. Only the stages that ask to be resumable
    (tasks.RESUMABLE) keep theirs: a flow with a storage of its own would otherwise persist, and
    so cache, every task's result (the preflight and the fetch of missing files included)."""
    slug = result_storage()
    if slug is None:
        return {}
    return {"result_storage": slug, "result_serializer": "json", "persist_result": False}


def save_result_storage() -> dict:
    """Save the block `result_storage` names (a deployment's pull step: it runs on whichever
    machine takes the flow run, before the flow is loaded). It holds the bucket and folder
    only: credentials and endpoint stay boto3's own, read where the results are."""
    slug = result_storage()
    if slug is None:
        return {}
    remote = remote_root()  # a malformed URL is named here, before the run starts
    from prefect_aws import AwsCredentials, S3Bucket

    name = slug.split("/", 1)[1]
    with contextlib.suppress(ValueError):  # not saved yet
        saved = S3Bucket.load(name)
        if (saved.bucket_name, saved.bucket_folder) == (remote.bucket, remote.key(RESULTS)):
            return {"result_storage": slug}  # as every run after the first finds it
    S3Bucket(bucket_name=remote.bucket, bucket_folder=remote.key(RESULTS),
             credentials=AwsCredentials()).save(name, overwrite=True)
    return {"result_storage": slug}


def publish_dataset(remote: RemoteRoot, ref: DatasetRef) -> str | None:
    """The dataset version's folder as one archive (`datasets/<fingerprint>.tar`), once per
    version; its key, or None for a folder outside the home (a user's own folder, which every
    machine that may run the flow mounts)."""
    if not ref.source_root.is_relative_to(home()):
        return None
    key = remote.key("datasets", f"{ref.fingerprint}.tar")
    if not remote.exists(key):
        publish_folder(remote, ref.source_root, key)
    return key


def restore_dataset(remote: RemoteRoot, ref: DatasetRef) -> bool:
    """The dataset version's folder on this machine, at the path the prepare stage gave it,
    from the bucket's archive when it is not here; True when it was fetched."""
    folder = ref.source_root
    if folder.exists() or not folder.is_relative_to(home()):
        return False
    key = remote.key("datasets", f"{ref.fingerprint}.tar")
    with file_lock(folder.parent / f".{folder.name}.lock"):  # the prepare stage's own lock
        if folder.exists():
            return False
        if not remote.exists(key):
            raise RemoteRootError(
                f"the dataset {ref.source} (version {ref.fingerprint[:12]}) is neither at "
                f"{folder} nor in {remote}: the machine that prepared it did not publish it. "
                "Run the flow again with `force` to prepare it here")
        restore_folder(remote, key, folder)
    return True


def publish_run_outputs(remote: RemoteRoot, folder: Path) -> str:
    """A stage's outputs in the run folder (`train/`: best weights, job, history;
    `evaluation/`: predictions, metrics, pictures) as one archive beside its checkpoints,
    replaced each time; not the checkpoints (uploaded as they come) or the ranks' progress."""
    key = remote.key(folder.relative_to(home()).as_posix() + ".tar")
    publish_folder(remote, folder, key, skip={"checkpoints", "progress"})
    return key


def restore_run_outputs(remote: RemoteRoot, run_dir: Path) -> list[str]:
    """The files of the run's finished stages that this machine lacks (a retry on another
    machine after training ended), from their archives; the folders fetched."""
    fetched = []
    for stage in ("train", "evaluation"):
        key = remote.key((run_dir / stage).relative_to(home()).as_posix() + ".tar")
        if remote.exists(key):
            restore_folder(remote, key, run_dir / stage)
            fetched.append(stage)
    return fetched


def publish_folder(remote: RemoteRoot, folder: Path, key: str, skip: Iterable[str] = ()
                   ) -> None:
    """`folder`'s files as one object, `skip` subfolders left out, each file's modification
    time kept to the nanosecond."""
    files = sorted(p for p in folder.rglob("*") if p.is_file()
                   and not set(p.relative_to(folder).parts[:-1]) & set(skip))
    mtimes = {p.relative_to(folder).as_posix(): p.stat().st_mtime_ns for p in files}
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".publish.") as tmp:
        archive = Path(tmp) / "folder.tar"
        (Path(tmp) / MTIMES).write_text(json.dumps(mtimes))
        with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
            for path in files:
                tar.add(path, arcname=path.relative_to(folder).as_posix(), recursive=False)
            tar.add(Path(tmp) / MTIMES, arcname=MTIMES)
        remote.upload(archive, key)


def restore_folder(remote: RemoteRoot, key: str, folder: Path) -> None:
    """The archive at `key` into `folder`: the whole folder at once when it is not here, else
    the files it lacks (a file already here is this machine's and is kept)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".fetch.") as tmp:
        archive = Path(tmp) / "folder.tar"
        remote.download(key, archive)
        out = Path(tmp) / "folder"
        with tarfile.open(archive) as tar:
            tar.extractall(out, filter="data")  # no links out of it, no absolute paths
        mtimes = json.loads((out / MTIMES).read_text())
        (out / MTIMES).unlink()
        for relpath, ns in mtimes.items():
            os.utime(out / relpath, ns=(ns, ns))
        if not folder.exists():
            os.replace(out, folder)
            return
        for relpath in mtimes:
            if not (folder / relpath).exists():
                (folder / relpath).parent.mkdir(parents=True, exist_ok=True)
                os.replace(out / relpath, folder / relpath)


def restore_split(remote: RemoteRoot, split: SplitResult) -> bool:
    """The split's manifest, ledger, audit and decode stores on this machine, at the paths the
    split stage gave them, when they are not here; True when they were fetched. The manifest comes
    last: a restore cut off is done again."""
    if split.decoded_only or split.manifest.exists():
        return False
    base = remote.key("splits", split.manifest_sha256)
    folder = split.manifest.parent.parent
    with file_lock(folder.parent / f".{folder.name}.restore.lock"):
        if split.manifest.exists():
            return False
        if not remote.exists(f"{base}/{SPLIT_RECORD}"):
            raise RemoteRootError(
                f"the split {split.manifest_sha256[:12]} is neither at {split.manifest} nor "
                f"in {remote}: the machine that made it did not publish it. Run the flow again "
                "with `force` to split here")
        body = remote.client.get_object(Bucket=remote.bucket,
                                        Key=f"{base}/{SPLIT_RECORD}")["Body"].read()
        for name, sha in RemoteSplit.model_validate_json(body).stores.items():
            store = DecodeStore(folder, Geometry.parse(name))
            if not store.index_path.exists():
                _download_store(remote, sha, store)
        for name, target in ((LEDGER, folder / LEDGER),
                             (QUARANTINE, split.manifest.parent / QUARANTINE),
                             (AUDIT, split.manifest.parent / AUDIT)):
            if not target.exists() and remote.exists(f"{base}/{name}"):
                remote.download(f"{base}/{name}", target)
        remote.download(f"{base}/manifest.csv", split.manifest)
    return True


# --- checkpoints -----------------------------------------------------------------------------

def run_prefix(job: TrainJob) -> str:
    """The run's folder relative to the home: the same on every machine, and the prefix of its
    checkpoints in the bucket."""
    try:
        return job.output_dir.relative_to(home()).as_posix()
    except ValueError:
        return f"runs/{job.output_dir.parent.name}/{job.output_dir.name}"


@contextlib.contextmanager
def checkpoints_through(remote: RemoteRoot, job: TrainJob, resume: bool,
                        logger: logging.Logger | logging.LoggerAdapter
                        ) -> Iterator[CheckpointUploader]:
    """Around machine 0's launch: fetch the newest complete checkpoints first (a resume on a
    machine that has none of its own), upload each new one while training goes on."""
    prefix, local = f"{run_prefix(job)}/checkpoints", job.output_dir / "checkpoints"
    if resume:
        fetched = fetch_checkpoints(remote, prefix, local)
        if fetched:
            logger.info("fetched checkpoint(s) %s from %s", fetched, remote)
    uploads = CheckpointUploader(remote, local, prefix, logger)
    # Every machine resumes from what the bucket holds: a checkpoint complete only here would
    # make machine 0 start at a later epoch than the others.
    if resume and not uploads.sweep():
        raise RemoteRootError(f"the newest checkpoint could not be uploaded to {remote}; the "
                              "other machines could not resume from it (see the warning above)")
    with uploads:
        yield uploads
    logger.info("%d checkpoint(s) uploaded, %.0f MB in %.1f s in the background",
                len(uploads.uploaded), uploads.bytes / 1e6, uploads.seconds)


# --- checkpoint transfers --------------------------------------------------------------------

def remote_checkpoints(remote: RemoteRoot, prefix: str) -> dict[int, list[str]]:
    """The complete checkpoints under `prefix`: number -> keys (the marker last)."""
    by_folder: dict[str, list[str]] = {}
    for key in remote.keys(remote.key(prefix)):
        folder, _, _ = key.rpartition("/")
        by_folder.setdefault(folder, []).append(key)
    done = {}
    for folder, keys in by_folder.items():
        marker = f"{folder}/{STATE_FILE}"
        if marker in keys and checkpoint_number(folder) >= 0:
            done[checkpoint_number(folder)] = sorted(keys, key=lambda k: k == marker)
    return done


def fetch_checkpoints(remote: RemoteRoot, prefix: str, local: Path) -> list[int]:
    """Download the complete remote checkpoints newer than every complete local one (the
    newest may be an interrupted epoch another world size cannot resume, hence all of them)."""
    here = [checkpoint_number(p.parent.name) for p in local.glob(f"checkpoint_*/{STATE_FILE}")]
    newest_here = max(here, default=-1)
    fetched = []
    for number, keys in sorted(remote_checkpoints(remote, prefix).items()):
        if number <= newest_here:
            continue
        final = local / f"checkpoint_{number}"
        tmp = local / f".fetch-checkpoint_{number}"
        shutil.rmtree(tmp, ignore_errors=True)
        for key in keys:
            remote.download(key, tmp / key.rpartition("/")[2])
        shutil.rmtree(final, ignore_errors=True)  # a local save cut off before its marker
        os.replace(tmp, final)
        fetched.append(number)
    # Folders without a marker: a save cut off here, or (on machines 1..) the ranks' own random
    # states of a checkpoint whose marker is machine 0's. Accelerate refuses to save into an
    # existing folder, so none may outlive the resume.
    for folder in local.glob("checkpoint_*"):
        if not (folder / STATE_FILE).exists():
            shutil.rmtree(folder, ignore_errors=True)
    return fetched


class CheckpointUploader:
    """Uploads each complete local checkpoint while training goes on, its marker last, and
    keeps the newest KEEP_CHECKPOINTS in the bucket. An upload that fails (the store is down,
    the folder was rotated away) is retried on the next look and never marked complete."""

    def __init__(self, remote: RemoteRoot, local: Path, prefix: str,
                 logger: logging.Logger | logging.LoggerAdapter):
        self.remote, self.local, self.prefix, self.logger = remote, local, prefix, logger
        self.uploaded: dict[int, int] = {}  # number -> the marker's mtime_ns
        self.seconds = 0.0
        self.bytes = 0
        self._stop = threading.Event()
        # In this task's context: its log lines go to the run's server (a thread without it
        # would start a temporary Prefect server of its own, seconds of CPU, to log to).
        self._thread = threading.Thread(target=contextvars.copy_context().run,
                                        args=(self._run,), name="checkpoint-upload",
                                        daemon=True)

    def __enter__(self) -> CheckpointUploader:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sweep()  # the last epoch's checkpoint, written just before the ranks ended

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.sweep()

    def sweep(self) -> bool:
        """Upload what is complete here and not yet there; False when an upload failed."""
        for marker in sorted(self.local.glob(f"checkpoint_*/{STATE_FILE}"),
                             key=lambda p: checkpoint_number(p.parent.name)):
            number = checkpoint_number(marker.parent.name)
            try:
                written = marker.stat().st_mtime_ns
                if self.uploaded.get(number) != written:
                    if not self._already_there(marker):
                        self._upload(marker.parent, number)
                    self.uploaded[number] = written
            except FileNotFoundError:
                continue  # rotated away by a newer one
            except Exception as e:  # the store being down costs the upload, not the training
                self.logger.warning("checkpoint %d not uploaded to %s yet: %s", number,
                                    self.remote, e)
                return False
        return True

    def _already_there(self, marker: Path) -> bool:
        """Complete in the bucket with the same state (an earlier attempt uploaded it)."""
        key = self.remote.key(self.prefix, marker.parent.name, STATE_FILE)
        if not self.remote.exists(key):
            return False
        body = self.remote.client.get_object(Bucket=self.remote.bucket, Key=key)["Body"].read()
        return body == marker.read_bytes()

    def _upload(self, folder: Path, number: int) -> None:
        started = time.perf_counter()
        base = self.remote.key(self.prefix, folder.name)
        marker_key = f"{base}/{STATE_FILE}"
        self.remote.delete([marker_key])  # a replaced (interrupted) one is incomplete meanwhile
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != STATE_FILE)
        for path in files:
            self.remote.upload(path, f"{base}/{path.name}")
            self.bytes += path.stat().st_size
        self.remote.upload(folder / STATE_FILE, marker_key)
        self.seconds += time.perf_counter() - started
        kept = sorted(remote_checkpoints(self.remote, self.prefix))
        for old in kept[:-KEEP_CHECKPOINTS]:
            old_base = self.remote.key(self.prefix, f"checkpoint_{old}")
            self.remote.delete([f"{old_base}/{STATE_FILE}"])  # incomplete first, then gone
            self.remote.delete(self.remote.keys(old_base))
        self.logger.info("checkpoint %d uploaded to %s", number, self.remote)
