"""Two machines sharing a folder against two machines sharing only a bucket.

    sudo .venv/bin/python -m bench.remote_root --pairs 2

Two network namespaces (tests/hosts.py), a Prefect server on their bridge and moto's S3 server
on every address. Machine 0 is this process's launch; machine 1 is a worker on host 1. Shared:
host 1 sees this home. Remote (TRAINFLOW_REMOTE_ROOT): host 1's worker has a home of its own
and this one is hidden from it; the split and checkpoints go through the bucket. Two datasets:
the digits at 12 px, 3 epochs, and 3,000 flowers photos (../shared/data/flowers-128, 600 per
class, hard-linked) at 64 px, 2 epochs; 2 processes per machine, runs alternated. The first
remote run of each split pays its publication and host 1's fetch; later ones find them.

Per run: the wall of the train task's call (`run_training`), what machine 0 uploaded (the
split, once, and each epoch's checkpoint, in a background thread: its seconds against the
epochs' time are the overlap), and what host 1 fetched.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHOTOS = Path(__file__).resolve().parents[2] / "shared" / "data" / "flowers-128"
KEYS = {"AWS_ACCESS_KEY_ID": "bench-key", "AWS_SECRET_ACCESS_KEY": "bench-secret",
        "AWS_DEFAULT_REGION": "us-east-1"}
REMOTE = {**KEYS, "TRAINFLOW_REMOTE_ROOT": "s3://bench/trainflow"}


class Uploads(logging.Handler):
    """The train task's own summary line of the checkpoint uploads."""

    def __init__(self):
        super().__init__()
        self.line = ""

    def emit(self, record: logging.LogRecord) -> None:
        if "checkpoint(s) uploaded" in record.getMessage():
            self.line = record.getMessage()


def flowers(folder: Path, per_class: int = 600) -> Path:
    for kind in sorted(p for p in PHOTOS.iterdir() if p.is_dir()):
        (folder / kind.name).mkdir(parents=True)
        for photo in sorted(kind.glob("*.jpg"))[:per_class]:
            os.link(photo, folder / kind.name / photo.name)
    return folder


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="trainflow-bench-remote-"))
    home, home_1 = folder / "home", folder / "home-1"
    home_1.mkdir(parents=True)
    os.environ.update(TRAINFLOW_HOME=str(home), PREFECT_HOME=str(folder / "client"),
                      DO_NOT_TRACK="1", OMP_NUM_THREADS="1")
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.train import run_training
    from tests.hosts import two_hosts, wait_ready
    from training.config import DatasetSpec, SplitSpec, TrainingSpec
    from training.data.sides import split_sides
    from training.data.sources import prepare
    from training.data.split import split_dataset
    from training.handoff import TrainJob
    from training.processes import free_port, kill_tree

    logger = logging.getLogger("bench.remote_root")
    logger.setLevel(logging.INFO)
    uploads = Uploads()
    logger.addHandler(uploads)
    cases = {
        "digits, 12 px, 3 epochs": ("builtin:digits", {"epochs": 3, "image_size": 12}),
        "3,000 photos, 64 px, 2 epochs": (str(flowers(folder / "flowers")),
                                          {"epochs": 2, "image_size": 64}),
    }
    splits = {}
    for name, (source, fields) in cases.items():
        spec = TrainingSpec(**fields, batch_size=32, num_processes=2)
        splits[name] = split_dataset(prepare(DatasetSpec(source=source), home), SplitSpec(),
                                     home, split_sides(spec))
    port = free_port()
    s3 = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p",
                           str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    walls: dict[tuple[str, str], list[float]] = {}
    rows = []
    try:
        time.sleep(3)
        import boto3

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                     aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"]
                     ).create_bucket(Bucket="bench")
        with two_hosts(folder, {"TRAINFLOW_HOME": str(home), "OMP_NUM_THREADS": "1"}) as hosts, \
                temporary_settings({PREFECT_API_URL: hosts.api}):
            hosts.start_worker(1, "remote-1", env={
                **REMOTE, "TRAINFLOW_HOME": str(home_1),
                "AWS_ENDPOINT_URL_S3": f"http://{hosts.gateway}:{port}"}, hidden=[home])
            wait_ready(hosts, ["remote-1"])
            for pair in range(args.pairs):
                for name, (_, fields) in cases.items():
                    for setup in ("shared", "remote"):
                        remote = setup == "remote"
                        for key, value in {**REMOTE, "AWS_ENDPOINT_URL_S3":
                                           f"http://127.0.0.1:{port}"}.items():
                            if remote:
                                os.environ[key] = value
                            else:
                                os.environ.pop(key, None)
                        spec = TrainingSpec(**fields, batch_size=32, num_processes=2,
                                            num_machines=2, node_work_queue=(
                                                "remote-{machine_rank}" if remote
                                                else "machine-{machine_rank}"))
                        job = TrainJob(split=splits[name], training=spec,
                                       output_dir=home / "runs" / f"{pair}-{setup}-{len(rows)}"
                                       / "train")
                        fetched_before = folder_bytes(home_1 / "fetched") if remote else 0
                        uploads.line = ""
                        started = time.perf_counter()
                        result = run_training(job, logger, resume=False)
                        wall = time.perf_counter() - started
                        epochs = sum(h.epoch_seconds for h in result.history)
                        fetched = (folder_bytes(home_1 / "fetched") - fetched_before
                                   if remote else 0)
                        uploaded = re.search(r"(\d+) checkpoint\(s\) uploaded, (\d+) MB in "
                                             r"([\d.]+) s", uploads.line)
                        walls.setdefault((name, setup if pair or not remote else "first"),
                                         []).append(wall)
                        rows.append((pair + 1, name, setup, result.world_size, wall, epochs,
                                     uploaded.groups() if uploaded else None, fetched))
                        print(rows[-1], flush=True)
    finally:
        kill_tree(s3)
    print("\n| pair | data | setup | world | wall s | epochs s | checkpoints up (MB, s) | "
          "host 1 fetched MB |\n|---|---|---|---|---|---|---|---|")
    for pair, name, setup, world, wall, epochs, up, fetched in rows:
        ups = f"{up[0]} ({up[1]} MB, {up[2]} s)" if up else "-"
        print(f"| {pair} | {name} | {setup} | {world} | {wall:.1f} | {epochs:.1f} | {ups} | "
              f"{fetched / 1e6:.1f} |")
    print("\n| data | shared, median s | remote after the first, median s | first remote |")
    print("|---|---|---|---|")
    for name in cases:
        shared = statistics.median(walls[(name, "shared")])
        later = walls.get((name, "remote"))
        first = walls[(name, "first")][0]
        print(f"| {name} | {shared:.1f} | {statistics.median(later):.1f} | {first:.1f} |"
              if later else f"| {name} | {shared:.1f} | - | {first:.1f} |")


if __name__ == "__main__":
    main()
