"""Faster steps where the hardware allows? channels_last and bf16 autocast, each on and off.

    python -m bench.step_options --images 3000 --rounds 2

Our training launch (2 processes, resnet18 64 px, 2 epochs, warm decode cache) on the generated
photos of bench/scale.py; the four combinations alternate within each round. Images/s of
epoch 2 (epoch 1 carries one-off costs), medians over rounds.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
from pathlib import Path

OPTIONS = {"fp32, contiguous": {"channels_last": False},
           "fp32, channels_last": {"channels_last": True},
           "fp32, channels_last, 1 loader worker": {"loader_workers": 1},
           "bf16, contiguous": {"mixed_precision": "bf16", "channels_last": False},
           "bf16, channels_last": {"mixed_precision": "bf16", "channels_last": True}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="trainflow-bench-steps-"))
    os.environ["TRAINFLOW_HOME"] = str(home)
    import torch

    from bench.scale import photos
    from tasks.preflight import cpu_has_bf16
    from tasks.train import run_training
    from training.config import DatasetSpec, SplitSpec
    from training.data.sources import prepare
    from training.data.split import split_dataset
    from training.handoff import TrainJob

    options = {name: o for name, o in OPTIONS.items() if "bf16" not in name
               or torch.cuda.is_available() or cpu_has_bf16()}
    if len(options) < len(OPTIONS):
        print("no GPU and no bf16 instructions on this CPU: bf16 (emulated, 28x slower) is "
              "left out", flush=True)
    root = photos(args.images)
    split = split_dataset(prepare(DatasetSpec(source=str(root.parent), labels="filename",
                                              subdir="train"), home), SplitSpec(), home)
    logger = logging.getLogger("bench.steps")
    speed: dict[str, list[float]] = {name: [] for name in options}
    try:
        for round_ in range(args.rounds):
            for name, option in options.items():
                training = {"model": "resnet18", "image_size": 64, "batch_size": 64,
                            "epochs": 2, "num_processes": 2, **option}
                job = TrainJob(split=split, training=training,
                               output_dir=home / f"{round_}-{name.replace(', ', '-')}")
                result = run_training(job, logger, resume=False)
                speed[name].append(result.history[-1].images_per_second)
                print(f"round {round_ + 1} {name}: {speed[name][-1]:.0f} images/s", flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    base = statistics.median(speed["fp32, contiguous"])
    print("\n| option | epoch-2 images/s, median (runs) | vs fp32 contiguous |\n|---|---|---|")
    for name, values in speed.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.0f} ({', '.join(f'{v:.0f}' for v in values)}) | "
              f"{med / base:.2f}x |")


if __name__ == "__main__":
    main()
