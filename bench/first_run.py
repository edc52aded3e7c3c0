"""A hand-started digits flow, three ways, alternated in one invocation:

- temporary: what a hand-started flow did before, Prefect's temporary server for the one run
  (the flow called from Python with no PREFECT_API_URL);
- first start: `trainflow train` on a fresh Prefect home, which starts the local server;
- reused: `trainflow train` again, the local server already up.

    .venv/bin/python -m bench.first_run --pairs 3

Each run trains the demo's recipe (digits, 3 epochs, 2 processes) with force, so every run
trains. Prints the wall-clock medians and the ratio to the temporary-server run, and for the
`trainflow train` runs the fixed cost: the flow run's wall time (Prefect's start to end) minus
the epochs' time (the ranks' epoch_seconds), with the flow's time per stage.
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


def timed(command: list[str], env: dict, costs: list[dict] | None = None) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-3000:])
    seconds = time.perf_counter() - started
    if costs is not None:
        costs.append(fixed_cost(json.loads(done.stdout), env))
    return seconds


def fixed_cost(result: dict, env: dict) -> dict:
    """The flow run's wall time, its epochs' time and each task's, from Prefect and the result."""
    import httpx

    api = json.loads((Path(env["PREFECT_HOME"]) / "trainflow-server.json").read_text())["url"]
    run_id = result["prefect_url"].rstrip("/").rsplit("/", 1)[-1]
    flow_run = httpx.get(f"{api}/flow_runs/{run_id}").json()
    tasks = httpx.post(f"{api}/task_runs/filter", json={
        "flow_runs": {"id": {"any_": [run_id]}}}).json()
    epochs = sum(h["epoch_seconds"] for h in result["trained"]["history"])
    stages = {t["name"].rsplit("-", 1)[0]: t["total_run_time"] for t in
              sorted(tasks, key=lambda t: t["start_time"] or "")}
    return {"flow": flow_run["total_run_time"], "epochs": epochs,
            "fixed": flow_run["total_run_time"] - epochs, "stages": stages}


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
    cli = [str(BIN / "trainflow"), "train", "--training.epochs", str(args.epochs), "--force",
           "--json"]
    costs: dict[str, list[dict]] = {"first start": [], "reused": []}
    try:
        timed(cli, shared)  # warm the data caches and the shared server once
        for i in range(args.pairs):
            fresh = {**shared, "PREFECT_HOME": str(root / f"p{i + 1}")}
            times["temporary"].append(timed([sys.executable, "-c", TEMPORARY,
                                             json.dumps(params)], fresh))
            times["first start"].append(timed(cli, fresh, costs["first start"]))
            subprocess.run([str(BIN / "trainflow"), "services", "stop", "--folder",
                            str(root / "svc")], env=fresh, capture_output=True)
            times["reused"].append(timed(cli, shared, costs["reused"]))
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
    print("\n| run | flow s | epochs s | fixed s (flow - epochs) | stages (median s) |\n"
          "|---|---|---|---|---|")
    for name, runs in costs.items():
        stages = {stage: statistics.median(r["stages"].get(stage, 0) for r in runs)
                  for stage in runs[0]["stages"]}
        cells = [statistics.median(r[k] for r in runs) for k in ("flow", "epochs", "fixed")]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " | " + ", ".join(
            f"{stage} {s:.1f}" for stage, s in stages.items()) + " |")
        fixed = ", ".join(f"{r['fixed']:.1f}" for r in runs)
        print(f"| {name}, each run | | | {fixed} | |")


if __name__ == "__main__":
    main()
