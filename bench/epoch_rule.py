"""The kept epoch: which epoch each rule keeps, against the best epoch in hindsight, from scratch.

    .venv/bin/python -m bench.epoch_rule --seeds 3                  # every set below
    .venv/bin/python -m bench.epoch_rule --sets flowers --seeds 1   # one set

Each set is trained once per seed with the product's launch (`tasks.train.run_training`, 2
processes) for every epoch; each epoch's weights (its checkpoint) are scored on held-out
images in neither split. The rules are then replayed on the run's own validation history
(`training.engine.checkpoint.better`, the code the launch runs):
- `val_accuracy~val_loss`: today's auto: the val figure of the gate's metric (accuracy), and
  within the val split's binomial noise the lower val loss;
- `val_loss`: the rule before it; `val_accuracy`: the rule before that (exact ties by loss).
Sets: bench.quality's generated ones (resnet18 at 32 px, 8 epochs) and flowers-128's real
photos (resnet18 at 64 px, 8 epochs; its 20% held out as bench.transfer holds it out).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.quality import COMMON, digits_photo, held_out_images, score_ours, shapes
from bench.transfer import FLOWERS, write_flowers
from tasks.train import run_training
from training.config import DatasetSpec, SplitSpec
from training.data.sources import prepare
from training.data.split import split_dataset
from training.engine.checkpoint import better
from training.handoff import TrainJob

LOG = logging.getLogger("bench-epoch-rule")
RULES = ("val_accuracy~val_loss", "val_loss", "val_accuracy")
SETS = {
    "digits-photo": ({}, lambda folder, held: digits_photo(folder, held)),
    "shapes": ({}, lambda folder, held: shapes(folder, held)),
    "digits-imbalanced": ({}, lambda folder, held: digits_photo(
        folder, held, keep=[1, 1, .6, .6, .35, .35, .2, .2, .12, .12])),
    "flowers": ({"image_size": 64}, None),
}


def kept(history: list[dict], rule: str) -> int:
    """The epoch `rule` keeps, replayed as the launch decides it: epoch by epoch."""
    best = None
    for figures in history:
        if best is None or better(figures, best, rule):
            best = figures
    return best["epoch"]


def one_run(split, folder: Path, images, settings: dict) -> tuple[list[dict], dict[int, float]]:
    """Every epoch's val figures and held-out accuracy, from one launch."""
    job = TrainJob(split=split, output_dir=folder / "train",
                   training={**COMMON, **settings, "choose_epoch": "last"})
    saved = folder / "epochs"
    saved.mkdir(parents=True, exist_ok=True)

    def keep_weights(event) -> None:  # the checkpoint exists when its epoch is reported
        shutil.copyfile(Path(event.checkpoint) / "model.safetensors",
                        saved / f"{event.epoch}.safetensors")

    result = run_training(job, LOG, resume=False, on_epoch=keep_weights)
    history = [{"epoch": h.epoch, **h.figures()} for h in result.history]
    scores = {h["epoch"]: score_ours(job, saved / f"{h['epoch']}.safetensors", images)
              for h in history}
    return history, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed onwards")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--sets", default=",".join(SETS))
    args = parser.parse_args()
    logging.disable(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="trainflow-bench-epoch-rule-") as folder:
        os.environ["TRAINFLOW_HOME"] = folder
        started = time.time()
        lines = table(Path(folder), args.sets.split(","),
                      range(args.first_seed, args.first_seed + args.seeds), args.epochs)
    print("\n".join([*lines, "", f"bench wall time: {time.time() - started:.0f} s"]))


def table(home: Path, sets: list[str], seeds: range, epochs: int) -> list[str]:
    """Every seed's row, then the medians."""
    header = ("| set | seed | epochs kept (" + ", ".join(RULES) + ", hindsight) | held-out "
              "accuracy: " + " | ".join(RULES) + " | best in hindsight |")
    lines = [header, "|" + "---|" * (len(RULES) + 4)]
    summary: dict[str, dict[str, list[float]]] = {}
    for name in sets:
        settings, make = SETS[name]
        folder = home / name
        if make is None:
            write_flowers(folder / "data", FLOWERS)
            held = folder / "data" / "test"
        else:
            held = folder / "held-out"
            make(folder / "data", held)
        split = split_dataset(prepare(DatasetSpec(source=str(folder / "data")), home),
                              SplitSpec(), home)
        images = held_out_images(held, split.class_names)
        for seed in seeds:
            history, scores = one_run(split, folder / f"seed-{seed}", images,
                                      {**settings, "epochs": epochs, "seed": seed})
            kept_epochs = [kept(history, rule) for rule in RULES]
            hindsight = max(scores, key=lambda e: (scores[e], e))
            row = summary.setdefault(name, {})
            for rule, epoch in zip(RULES, kept_epochs, strict=True):
                row.setdefault(rule, []).append(scores[epoch])
            row.setdefault("hindsight", []).append(scores[hindsight])
            lines.append(f"| {name} | {seed} | {', '.join(map(str, kept_epochs))}, "
                         f"{hindsight} | " + " | ".join(f"{scores[e]:.3f}" for e in kept_epochs)
                         + f" | {scores[hindsight]:.3f} |")
            print(lines[-1], flush=True)
    lines += ["", "| set (median of seeds) | " + " | ".join(RULES) + " | hindsight |",
              "|" + "---|" * (len(RULES) + 2)]
    for name, row in summary.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{statistics.median(v):.3f}" for v in row.values()) + " |")
    return lines


if __name__ == "__main__":
    main()
