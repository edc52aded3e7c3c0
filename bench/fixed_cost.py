"""A hand-started digits run's time, this checkout against an earlier commit, alternated.

    .venv/bin/python -m bench.fixed_cost --before d4e60d7 --pairs 3
    # another recipe: these flags go to every run
    .venv/bin/python -m bench.fixed_cost --before d4e60d7 --recipe "--training.model resnet18 ..."

Both run `trainflow train --training.epochs 3 --force` (the demo's recipe) on one reused local
Prefect server, each version with its own home. Per pair and version:
- gated: a champion exists and the gate's cache is emptied first, so the champion is scored;
- ungated: a new model name, so there is no champion to score.

The earlier commit runs from a git worktree with this environment. Prints each run's summary
`time` line (the flow's stages) and the medians of the flow's time and the process's wall.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(checkout: Path, home: Path, env: dict, extra: list[str]) -> tuple[float, float, str]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "commands.main", "train", "--training.epochs", "3", "--force",
         *extra], cwd=checkout, env={**env, "TRAINFLOW_HOME": str(home)},
        capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-3000:])
    line = next(line for line in done.stdout.splitlines() if line.startswith("time"))
    return wall, float(re.search(r"time\s+([\d.]+) s", line)[1]), line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the commit to compare with")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--recipe", default="", help="more `trainflow train` flags for every run, "
                        "e.g. \"--dataset.source DIR --training.model resnet18\"")
    args = parser.parse_args()
    recipe = shlex.split(args.recipe)
    root = Path(tempfile.mkdtemp(prefix="bench-fixed-cost-"))
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(root / "before"),
                    args.before], cwd=REPO, check=True, capture_output=True)
    checkouts = {"before": root / "before", "after": REPO}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_API", "MLFLOW_"))}
    env["PREFECT_HOME"] = str(root / "prefect")  # one local server, started by the first run
    runs: dict[str, list[tuple]] = {name: [] for name in checkouts}
    try:
        for name, checkout in checkouts.items():
            run(checkout, root / name, env, recipe)  # the champion, and warm data caches
        for pair in range(args.pairs):
            order = list(checkouts.items())  # which version goes first alternates by pair
            for name, checkout in order if pair % 2 == 0 else order[::-1]:
                shutil.rmtree(root / name / "gate", ignore_errors=True)
                gated = run(checkout, root / name, env, recipe)
                ungated = run(checkout, root / name, env,
                              [*recipe, "--registry.model_name", f"fresh-{pair}"])
                runs[name].append((gated, ungated))
                print(f"{name}\n  gated   {gated[2]}\n  ungated {ungated[2]}", flush=True)
        print("\n| run | " + " | ".join(f"{n}: flow s (wall s)" for n in checkouts) +
              " |\n|---|---|---|")
        for i, kind in enumerate(("gated (champion scored)", "ungated (first version)")):
            cells = [f"{statistics.median(r[i][1] for r in runs[n]):.1f} "
                     f"({statistics.median(r[i][0] for r in runs[n]):.1f})" for n in checkouts]
            print(f"| {kind} | " + " | ".join(cells) + " |")
    finally:
        # Only this bench's local server (its PREFECT_HOME), never the user's services.
        subprocess.run([sys.executable, "-c", "from commands.local_server import stop; stop()"],
                       env=env, cwd=REPO, capture_output=True)
        subprocess.run(["git", "worktree", "remove", "--force", str(root / "before")],
                       cwd=REPO, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
