"""What a new split costs a machine that fetches it from TRAINFLOW_REMOTE_ROOT.

    python -m bench.remote_store --repeats 3

A decode store is one object of rows * 3 * side * side bytes (runtime/remote.py). For a 3k
and a 25k image split at 64 px, alternated per repeat: the flow machine's upload of the store
(`RemoteRoot.upload`, boto3's transfer manager) and another machine's download
(`RemoteRoot.download`), through moto's S3 server on this machine's loopback. Wall seconds,
medians, and MB/s. The 1.28M-image ImageNet row at 224 px is computed from the measured rate
and, for a real object store, from 1 GB/s.

A flow run retried on another machine also fetches the dataset version (one archive with its
files' modification times, `publish_folder`/`restore_folder`): the same alternation for the
built-in digits (1,797 PNGs) and ../shared/data/flowers-128 (4,317 JPEG photos) copied into a
version folder, when that folder is there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {"3k at 64 px": 3_000 * 3 * 64 * 64, "25k at 64 px": 25_000 * 3 * 64 * 64}
IMAGENET = 1_281_167 * 3 * 224 * 224


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from training.processes import free_port

    port = free_port()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
                       "TRAINFLOW_REMOTE_ROOT": "s3://bench/trainflow"})
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        from runtime.remote import remote_root

        time.sleep(3)
        remote = remote_root()
        remote.client.create_bucket(Bucket="bench")
        up: dict[str, list[float]] = {name: [] for name in SIZES}
        down: dict[str, list[float]] = {name: [] for name in SIZES}
        with tempfile.TemporaryDirectory() as tmp:
            for name, size in SIZES.items():
                with open(Path(tmp) / name, "wb") as f:
                    f.write(os.urandom(size))
            for repeat in range(args.repeats):
                for name in SIZES:
                    key = remote.key("stores", f"{repeat}-{name}", "images.u8")
                    started = time.perf_counter()
                    remote.upload(Path(tmp) / name, key)
                    up[name].append(time.perf_counter() - started)
                    started = time.perf_counter()
                    remote.download(key, Path(tmp) / "fetched" / name)
                    down[name].append(time.perf_counter() - started)
                    remote.delete([key])
        folders_table(remote, args.repeats)
        print()
        print("| store | MB | upload s | download s | download MB/s |")
        print("|---|---|---|---|---|")
        rate = 0.0
        for name, size in SIZES.items():
            u, d = statistics.median(up[name]), statistics.median(down[name])
            rate = size / d
            print(f"| {name} | {size / 1e6:,.0f} | {u:.2f} | {d:.2f} | {rate / 1e6:,.0f} |")
        print(f"| 1.28M at 224 px (on paper) | {IMAGENET / 1e6:,.0f} | | "
              f"{IMAGENET / rate:,.0f} at this rate; {IMAGENET / 1e9:,.0f} at 1 GB/s | |")
    finally:
        server.kill()


def folders_table(remote, repeats: int) -> None:
    """Dataset version folders: their archive's upload, and another machine's fetch."""
    import shutil

    from runtime.remote import publish_folder, restore_folder
    from training.data.sources import write_digits

    photos = Path(__file__).resolve().parents[2] / "shared" / "data" / "flowers-128"
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"digits (1,797 PNGs)": write_digits(Path(tmp) / "digits")}
        if photos.is_dir():
            folders["flowers-128 (4,317 photos)"] = Path(shutil.copytree(
                photos, Path(tmp) / "flowers", ignore=shutil.ignore_patterns("*.txt")))
        up: dict[str, list[float]] = {name: [] for name in folders}
        down: dict[str, list[float]] = {name: [] for name in folders}
        archive_mb: dict[str, float] = {}
        for repeat in range(repeats):
            for name, folder in folders.items():
                key = remote.key("datasets", f"{repeat}-{folder.name}.tar")
                started = time.perf_counter()
                publish_folder(remote, folder, key)
                up[name].append(time.perf_counter() - started)
                elsewhere = Path(tmp) / "elsewhere" / f"{repeat}-{folder.name}"
                started = time.perf_counter()
                restore_folder(remote, key, elsewhere)
                down[name].append(time.perf_counter() - started)
                archive_mb[name] = remote.client.head_object(
                    Bucket=remote.bucket, Key=key)["ContentLength"] / 1e6
                remote.delete([key])
        print("| dataset version folder | archive MB | publish s | fetch s |")
        print("|---|---|---|---|")
        for name in folders:
            print(f"| {name} | {archive_mb[name]:.1f} | {statistics.median(up[name]):.2f} | "
                  f"{statistics.median(down[name]):.2f} |")


if __name__ == "__main__":
    main()
