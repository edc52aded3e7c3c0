"""What a remote root costs a whole train-flow run on one machine.

    python -m bench.remote_flow --pairs 3

`trainflow train` on the built-in digits (3 epochs), with and without
TRAINFLOW_REMOTE_ROOT (moto's S3 server on loopback), runs alternated, each setup with a home
of its own kept across its runs (as a user's retrains). With the remote root a run also
publishes what a retry on another machine needs: the dataset version and the split (once per
version: the first run), each epoch's checkpoint (in the background) and the run's outputs,
and keeps the stages' results in the bucket. Wall seconds of the CLI, the flow's own time,
the bucket's growth per run, and the CPU seconds moto's S3 server spent serving it (on this
2-core machine the store competes with the run for the cores; a real one is elsewhere).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

KEYS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1"}
COMMAND = ["trainflow", "train", "--dataset.source", "builtin:digits", "--training.epochs", "3",
           "--force"]


def bucket_bytes(remote) -> int:
    pages = remote.client.get_paginator("list_objects_v2").paginate(Bucket=remote.bucket)
    return sum(item["Size"] for page in pages for item in page.get("Contents", []))


def run(env: dict) -> tuple[float, float]:
    started = time.perf_counter()
    done = subprocess.run([str(Path(sys.executable).parent / COMMAND[0]), *COMMAND[1:]],
                          env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    flow = re.search(r"^time\s+([\d.]+) s", done.stdout, re.M)
    return wall, float(flow.group(1)) if flow else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    from training.processes import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            endpoint = {**KEYS, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}
            os.environ.update(endpoint)
            os.environ["TRAINFLOW_REMOTE_ROOT"] = "s3://bench/trainflow"
            time.sleep(3)
            from runtime.remote import remote_root

            remote = remote_root()
            remote.client.create_bucket(Bucket="bench")
            del os.environ["TRAINFLOW_REMOTE_ROOT"]
            setups = {
                "shared home": {**os.environ, "TRAINFLOW_HOME": f"{tmp}/shared"},
                "remote root": {**os.environ, **endpoint, "TRAINFLOW_HOME": f"{tmp}/remote",
                                "TRAINFLOW_REMOTE_ROOT": "s3://bench/trainflow"},
            }
            run(setups["shared home"])  # the reused local Prefect server starts here
            rows = []
            store = psutil.Process(server.pid)
            for pair in range(1, args.pairs + 1):
                for name, env in setups.items():
                    before, cpu = bucket_bytes(remote), sum(store.cpu_times()[:2])
                    wall, flow = run(env)
                    rows.append((pair, name, wall, flow, bucket_bytes(remote) - before,
                                 sum(store.cpu_times()[:2]) - cpu))
        print("| pair | setup | CLI wall s | flow s | bucket grew MB | S3 server CPU s |")
        print("|---|---|---|---|---|---|")
        for pair, name, wall, flow, grew, cpu in rows:
            print(f"| {pair} | {name} | {wall:.1f} | {flow:.1f} | {grew / 1e6:.1f} | {cpu:.1f} |")
        for name in setups:
            walls = [row[2] for row in rows if row[1] == name]
            print(f"{name}: median CLI wall {statistics.median(walls):.1f} s")
        shared = statistics.median(row[2] for row in rows if row[1] == "shared home")
        remote_ = statistics.median(row[2] for row in rows if row[1] == "remote root")
        print(f"remote/shared: {remote_ / shared:.3f} ({remote_ - shared:+.1f} s)")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
