"""A hand-started digits flow, three ways, alternated in one invocation:

- temporary: what a hand-started flow did before, Prefect's temporary server for the one run
  (the flow called from Python with no PREFECT_API_URL);
- first start: `trainflow train` on a fresh Prefect home, which starts the local server;
- reused: `trainflow train` again, the local server already up.

    .venv/bin/python -m bench.first_run --pairs 3

Each run trains the demo's recipe (digits, 3 epochs, 2 processes) with force, so every run
trains. Prints the wall-clock medians and the ratio to the temporary-server run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
TEMPORARY = """
import json, sys
from flows.train_flow import train_flow
train_flow(**json.loads(sys.argv[1]), force=True)
"""


def timed(command: list[str], env: dict) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-3000:])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    params = {"dataset": {"source": "builtin:digits"}, "training": {"epochs": args.epochs}}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    root = Path(tempfile.mkdtemp(prefix="bench-first-run-"))
    shared = {**base, "TRAINFLOW_HOME": str(root / "home"), "PREFECT_HOME": str(root / "p0")}
    times: dict[str, list[float]] = {"temporary": [], "first start": [], "reused": []}
    cli = [str(BIN / "trainflow"), "train", "--training.epochs", str(args.epochs), "--force"]
    try:
        timed(cli, shared)  # warm the data caches and the shared server once
        for i in range(args.pairs):
            fresh = {**shared, "PREFECT_HOME": str(root / f"p{i + 1}")}
            times["temporary"].append(timed([sys.executable, "-c", TEMPORARY,
                                             json.dumps(params)], fresh))
            times["first start"].append(timed(cli, fresh))
            subprocess.run([str(BIN / "trainflow"), "services", "stop", "--folder",
                            str(root / "svc")], env=fresh, capture_output=True)
            times["reused"].append(timed(cli, shared))
    finally:
        subprocess.run([str(BIN / "trainflow"), "services", "stop", "--folder",
                        str(root / "svc")], env=shared, capture_output=True)
    reference = statistics.median(times["temporary"])
    print(f"| run ({args.pairs} alternated, {args.epochs} epochs) | median s | runs | "
          "vs temporary |\n|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {', '.join(f'{v:.1f}' for v in values)} | "
              f"{median / reference:.2f}x |")


if __name__ == "__main__":
    main()
