"""The flagship size at 224 px: decode once, then train one epoch, within this machine's memory.

    python -m bench.memory --images 25000 --image-size 224 --model mobilenet_v3_small

25,000 generated photos (bench/scale.py's cache), split with the decode at the training's
sides (256 px for augmented training crops, 224 px for validation and test), then one epoch of
a real 2-process training launch on them. A cheap model (mobilenet_v3_small) keeps the epoch
to minutes on a CPU; the input pipeline, the decode store and its memory map are the same as
for VGG16 or resnet18. A sampler records, every 0.5 s, the launch's processes' resident memory
(private and file-backed), the machine's available memory and swap.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path

import psutil


class MemorySampler(threading.Thread):
    def __init__(self, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.every_s, self.stop = every_s, threading.Event()
        self.anon = self.file = 0
        self.least_available = psutil.virtual_memory().available
        self.swap_before = psutil.swap_memory().used
        self.most_swap = 0

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.wait(self.every_s):
            anon = file = 0
            for process in [me, *me.children(recursive=True)]:
                try:
                    status = Path(f"/proc/{process.pid}/status").read_text()
                except OSError:
                    continue
                fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
                anon += int(fields.get("RssAnon", "0 kB").split()[0]) * 1024
                file += int(fields.get("RssFile", "0 kB").split()[0]) * 1024
            self.anon, self.file = max(self.anon, anon), max(self.file, file)
            self.least_available = min(self.least_available, psutil.virtual_memory().available)
            self.most_swap = max(self.most_swap, psutil.swap_memory().used - self.swap_before)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=25000)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    home = Path(tempfile.mkdtemp(prefix="trainflow-bench-memory-"))
    os.environ["TRAINFLOW_HOME"] = str(home)
    from bench.scale import photos
    from tasks.train import run_training
    from training.config import DatasetSpec, SplitSpec, TrainingSpec
    from training.data.sides import split_sides
    from training.data.sources import prepare
    from training.data.split import split_dataset
    from training.data.store import store_bytes
    from training.handoff import TrainJob

    root = photos(args.images)
    training = TrainingSpec(model=args.model, image_size=args.image_size, batch_size=64,
                            epochs=args.epochs, num_processes=2, augment="crop_flip")
    total = psutil.virtual_memory().total
    try:
        ref = prepare(DatasetSpec(source=str(root.parent), labels="filename", subdir="train"),
                      home)
        sampler = MemorySampler()
        sampler.start()
        started = time.perf_counter()
        split = split_dataset(ref, SplitSpec(val_fraction=0.2, test_fraction=0.1), home,
                              split_sides(training))
        split_s = time.perf_counter() - started
        sampler.stop.set()
        sampler.join()
        disk = store_bytes(split.manifest.parent.parent)
        decode_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        job = TrainJob(split=split, training=training, output_dir=home / "run")
        sampler = MemorySampler()
        sampler.start()
        started = time.perf_counter()
        result = run_training(job, logging.getLogger("bench.memory"), resume=False)
        train_s = time.perf_counter() - started
        sampler.stop.set()
        sampler.join()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    gb = 1e9
    epoch = result.history[-1]
    print("\n".join([
        f"{args.images} JPEGs at {args.image_size} px, {args.model}, {args.epochs} epoch(s), "
        f"2 processes, {os.cpu_count()} cores, {total / gb:.1f} GB memory", "",
        "| | |", "|---|---|",
        f"| split with the one decode ({split_sides(training)}) | {split_s:.0f} s |",
        f"| decoded images on disk | {disk / gb:.2f} GB |",
        f"| decoding process, peak resident | {decode_peak / gb:.2f} GB |",
        f"| training launch wall (1 process start, {args.epochs} epoch(s), test evaluation) "
        f"| {train_s:.0f} s, {epoch.images_per_second:.0f} images/s |",
        f"| training, peak private memory of all processes (RssAnon) | {sampler.anon / gb:.2f} GB |",
        f"| training, peak file-backed resident (the store's pages, shared) "
        f"| {sampler.file / gb:.2f} GB |",
        f"| machine's least available memory during training | "
        f"{sampler.least_available / gb:.1f} GB of {total / gb:.1f} GB |",
        f"| swap used during training | {sampler.most_swap / gb:.2f} GB |",
        f"| val accuracy after {args.epochs} epoch(s) | {epoch.get('val_accuracy', 0):.3f} |",
    ]))


if __name__ == "__main__":
    main()
