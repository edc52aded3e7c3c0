"""basicnet on the demo's data (scikit-learn's digits, 3 epochs, 2 processes): test accuracy of
the training defaults against candidate recipes, seeds alternated in one invocation.

    .venv/bin/python -m bench.demo_defaults --seeds 5

Every run trains exactly what `make demo` trains (the same split, the same launch), changing only
the seed and the recipe's fields, and reads the test split's accuracy that the ranks evaluate.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from tasks.evaluate import run_evaluation
from tasks.train import run_training
from training.config import DatasetSpec, SplitSpec, TrainingSpec
from training.data.sources import prepare
from training.data.split import split_dataset
from training.handoff import TrainJob

LOG = logging.getLogger("bench-demo-defaults")
CANDIDATES = {
    "before: batch 64, lr 1e-3, constant, no label smoothing": {
        "batch_size": 64, "lr": 1e-3, "lr_schedule": "constant", "label_smoothing": 0.0},
    "defaults": {},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=TrainingSpec().seed,
                        help="default: the training default's, the seed `make demo` trains with")
    parser.add_argument("--candidates", default=json.dumps(CANDIDATES),
                        help="JSON object: name -> training fields over the defaults")
    args = parser.parse_args()
    candidates = json.loads(args.candidates)
    home = Path(tempfile.mkdtemp(prefix="bench-demo-defaults-"))
    os.environ["TRAINFLOW_HOME"] = str(home)
    logging.disable(logging.INFO)
    try:
        split = split_dataset(prepare(DatasetSpec(source="builtin:digits"), home), SplitSpec(),
                              home)
        scores: dict[str, list[float]] = {name: [] for name in candidates}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for name, fields in candidates.items():  # alternated within each seed
                training = TrainingSpec(**{"epochs": args.epochs, "seed": seed, **fields})
                out = home / f"{len(scores[name])}-{seed}-{abs(hash(name))}"
                job = TrainJob(split=split, output_dir=out / "train", training=training)
                result = run_training(job, LOG, resume=False, evaluate_into=out / "evaluation")
                evaluation = run_evaluation(result, out / "evaluation", LOG)
                scores[name].append(evaluation.metrics["accuracy"])
                epochs_s = sum(h.epoch_seconds for h in result.history)
                print(f"seed {seed} {name}: {scores[name][-1]:.4f} ({epochs_s:.1f} s of epochs)",
                      flush=True)
        test_images = sum(split.counts["test"].values())
        print(f"\n{args.seeds} seeds, {args.epochs} epochs, {test_images} test images")
        print("| recipe | median | min | max | runs |\n|---|---|---|---|---|")
        for name, values in scores.items():
            print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} | "
                  f"{max(values):.3f} | {', '.join(f'{v:.3f}' for v in values)} |")
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
