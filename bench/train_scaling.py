"""Training throughput on digits: 1 vs 2 processes, epoch 1 vs later epochs, cold vs warm cache.

    .venv/bin/python -m bench.train_scaling [--pairs 3] [--epochs 4]

Runs bare `accelerate launch -m training.train` jobs in alternating 1/2-process pairs (the
machine is shared and noisy, so both sides of a ratio come from the same minutes) and prints
medians. Each pair also times one launch with a cold decode cache.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tasks.train import run_training
from training.config import DatasetSpec, SplitSpec
from training.data.sources import prepare
from training.data.split import split_dataset
from training.handoff import SplitResult, TrainJob


def one_run(split: SplitResult, folder: Path, processes: int, epochs: int, cold: bool) -> dict:
    if cold:
        shutil.rmtree(split.manifest.parent.parent / "decoded", ignore_errors=True)
    job = TrainJob(split=split, output_dir=folder,
                   training={"epochs": epochs, "num_processes": processes, "batch_size": 64,
                             "image_size": 28})
    started = time.perf_counter()
    result = run_training(job, logging.getLogger("bench"), resume=False)
    wall = time.perf_counter() - started
    assert result.world_size == processes
    history = result.history
    return {"wall": wall, "epoch1_s": history[0].epoch_seconds,
            "later_s": statistics.median(h.epoch_seconds for h in history[1:]),
            "epoch1_ips": history[0].images_per_second,
            "later_ips": statistics.median(h.images_per_second for h in history[1:])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-"))
    ref = prepare(DatasetSpec(source="builtin:digits"), home)
    split = split_dataset(ref, SplitSpec(), home)
    rows: dict[str, list[dict]] = {"1 process": [], "2 processes": [], "2 processes, cold cache": []}
    for pair in range(args.pairs):
        rows["1 process"].append(one_run(split, home / f"p1-{pair}", 1, args.epochs, False))
        rows["2 processes"].append(one_run(split, home / f"p2-{pair}", 2, args.epochs, False))
        rows["2 processes, cold cache"].append(
            one_run(split, home / f"c2-{pair}", 2, args.epochs, True))
    print(f"digits, basicnet 28 px, batch 64/process, {args.epochs} epochs, "
          f"medians of {args.pairs} alternating runs")
    print("| setting | launch wall s | epoch 1 s | epochs 2+ s | epoch 1 img/s | epochs 2+ img/s |")
    print("|---|---|---|---|---|---|")
    for name, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"| {name} | {med['wall']:.2f} | {med['epoch1_s']:.3f} | {med['later_s']:.3f} | "
              f"{med['epoch1_ips']:.0f} | {med['later_ips']:.0f} |")
    one, two = (statistics.median(r["later_ips"] for r in rows[k])
                for k in ("1 process", "2 processes"))
    print(f"\n2 vs 1 process, epochs 2+ images/s: {two / one:.2f}x")
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
