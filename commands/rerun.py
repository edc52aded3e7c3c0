"""Train again what produced a registered model version: its code and its parameters.

    trainflow rerun digits-classifier 3                      # here, in a worktree of its commit
    trainflow rerun digits-classifier 3 --deployment train-flow/digits   # via a worker

Here, the version's recorded commit is checked out into a git worktree (under the home) and
train-flow runs from there, so today's code does not stand in for the code that trained it.
It refuses when the commit is unknown to this clone or the version was trained from
uncommitted changes: neither can be reproduced. Only the fields that define the model are
replayed (the parameter blocks from the `trainflow.flow_parameters` tag, less the
launch-only training fields such as num_processes and ports, which belong to this machine). The
new run always trains (force) and goes through the gate like any other. Through a deployment,
the run uses the deployment's code, which the command says.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tasks.lineage import FLOW_PARAMETERS, GIT_COMMIT, GIT_DIRTY, REPO
from training.config import LAUNCH_ONLY
from training.storage import home, tracking_uri


def recorded(model_name: str, version: str) -> tuple[dict, dict]:
    from mlflow import MlflowClient

    tags = MlflowClient(tracking_uri()).get_model_version(model_name, version).tags
    if FLOW_PARAMETERS not in tags:
        raise SystemExit(f"{model_name} v{version} has no {FLOW_PARAMETERS} tag: it was not "
                         "registered by train-flow")
    params = json.loads(tags[FLOW_PARAMETERS])
    params["training"] = {k: v for k, v in params["training"].items() if k not in LAUNCH_ONLY}
    return params, tags


def reproducible_commit(model_name: str, version: str, tags: dict) -> str:
    commit = tags.get(GIT_COMMIT, "unknown")
    if commit in ("", "unknown"):
        raise SystemExit(f"{model_name} v{version} records no git commit: the code that trained "
                         "it is unknown, so it cannot be rerun exactly")
    if tags.get(GIT_DIRTY) != "false":
        raise SystemExit(f"{model_name} v{version} was trained from uncommitted changes on top "
                         f"of {commit[:12]} (or before this was recorded): its code is not in "
                         "git, so it cannot be rerun exactly")
    known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO,
                           capture_output=True)
    if known.returncode != 0:
        raise SystemExit(f"commit {commit[:12]} of {model_name} v{version} is not in this "
                         f"clone ({REPO}); `git fetch` the branch that has it, then run again")
    return commit


def worktree(commit: str):
    folder = home() / "rerun" / commit[:12]
    if not (folder / ".git").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(folder), commit], cwd=REPO,
                       check=True, capture_output=True)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trainflow rerun", description=__doc__.split("\n")[0])
    parser.add_argument("model_name")
    parser.add_argument("version")
    parser.add_argument("--deployment", help='e.g. "train-flow/digits": run through a worker')
    args = parser.parse_args(argv)
    params, tags = recorded(args.model_name, args.version)
    params["force"] = True
    if args.deployment:
        from prefect.deployments import run_deployment

        flow_run = run_deployment(args.deployment, parameters=params, timeout=0)
        print(f"started flow run {flow_run.id} of {args.deployment} with v{args.version}'s "
              f"parameters, on the deployment's code (v{args.version} was trained at "
              f"{tags.get(GIT_COMMIT, 'unknown')[:12]})")
        return
    commit = reproducible_commit(args.model_name, args.version, tags)
    folder = worktree(commit)
    print(f"rerunning {args.model_name} v{args.version} at commit {commit[:12]} in {folder}",
          file=sys.stderr)
    # The worktree's packages come first on the path: its code, not this checkout's.
    env = {**os.environ, "PYTHONPATH": str(folder)}
    with tempfile.TemporaryDirectory() as tmp:  # not in the worktree: it would read as dirty
        done = subprocess.run(entry(folder, params, Path(tmp)), cwd=folder, env=env)
    sys.exit(done.returncode)


def entry(folder: Path, params: dict, scratch: Path) -> list[str]:
    """How the worktree's own code starts train-flow with `params`: the CLI with a config file,
    or, in commits from before flows started only from the CLI, the flow module itself."""
    flow_module = (folder / "flows" / "train_flow.py").read_text()
    if 'if __name__ == "__main__":' in flow_module:
        return [sys.executable, "-m", "flows.train_flow", json.dumps(params)]
    config = scratch / "parameters.json"
    config.write_text(json.dumps({k: v for k, v in params.items() if k != "force"}))
    return [sys.executable, "-m", "commands.main", "train", "--config", str(config)] + (
        ["--force"] if params.get("force") else [])


if __name__ == "__main__":
    main()
