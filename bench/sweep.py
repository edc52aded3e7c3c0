"""What a sweep buys: best-of-sweep test accuracy against train-flow's defaults, and what
pruning saved.

    python -m bench.sweep --trials 8 --epochs 4 --sets digits,digits-photo

Both flows run on the real Prefect engine (a temporary server) and a throwaway MLflow store;
test accuracy is each registered model's, on the same test split.
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

SPACE = {"lr": {"log_uniform": [1e-4, 3e-2]}, "batch_size": {"choice": [32, 64]},
         "lr_schedule": {"choice": ["constant", "onecycle"]}}
SETS = {"digits": ({"source": "builtin:digits"}, {"model": "basicnet", "image_size": 28}),
        "digits-photo": (None, {"model": "resnet18", "image_size": 32, "batch_size": 32})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--sets", default="digits")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="trainflow-bench-sweep-"))
    os.environ.update(TRAINFLOW_HOME=str(home), PREFECT_HOME=str(home / "prefect"),
                      PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    logging.disable(logging.INFO)
    from prefect.testing.utilities import prefect_test_harness

    from bench.quality import digits_photo
    from flows.sweep_flow import sweep_flow
    from flows.train_flow import train_flow

    lines = [f"{args.trials} trials, {args.epochs} epochs each, search space {SPACE}", "",
             "| set | defaults: test accuracy, wall s | sweep: best test accuracy, wall s | "
             "trials complete / pruned | epochs not run (of all trials' epochs) |",
             "|---|---|---|---|---|"]
    try:
        with prefect_test_harness(server_startup_timeout=120):
            for name in args.sets.split(","):
                dataset, training = SETS[name]
                if dataset is None:
                    digits_photo(home / name / "data", home / name / "held-out")
                    dataset = {"source": str(home / name / "data")}
                training = {**training, "epochs": args.epochs}
                started = time.perf_counter()
                default = train_flow(dataset=dataset, training=training, force=True,
                                     registry={"model_name": f"{name}-defaults"})
                default_s = time.perf_counter() - started
                started = time.perf_counter()
                swept = sweep_flow(dataset=dataset, training=training, search_space=SPACE,
                                   n_trials=args.trials,
                                   registry={"model_name": f"{name}-sweep"})
                sweep_s = time.perf_counter() - started
                trials = swept.sweep.trials
                lines.append(
                    f"| {name} | {default.evaluation.metrics['accuracy']:.3f}, {default_s:.0f} | "
                    f"{swept.evaluation.metrics['accuracy']:.3f}, {sweep_s:.0f} | "
                    f"{trials['COMPLETE']} / {trials['PRUNED']} | {swept.sweep.epochs_not_run} "
                    f"of {args.trials * args.epochs} |")
                print(lines[-1], flush=True)
                print(f"  best params {swept.sweep.best_params}; default epoch s "
                      f"{statistics.median(h['epoch_seconds'] for h in default.trained.history):.1f}",
                      flush=True)
        print("\n".join(lines))
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
