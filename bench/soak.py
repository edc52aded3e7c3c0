"""make soak: many digits flow runs against one stack, with faults mixed in, then an audit.

    .venv/bin/python -m bench.soak --runs 20 --faults 10          # make soak
    .venv/bin/python -m bench.soak --runs 4 --kinds kill_rank,mlflow_restart   # CI's short one

The local stack (`trainflow services start`: Prefect and MLflow servers, a process worker) in a
temporary folder, and the `digits` deployment of prefect.yaml on a folder of digit PNGs. A run
is submitted every --interval seconds; the deployment and the pool run 2 at a time. Faults, one
per chosen run, cycling through the kinds:

  kill_rank        a rank SIGKILLs itself in epoch 2 (the train task's retry resumes)
  preempt          rank 0 SIGTERMs its launcher in epoch 2, as a spot notice (saved, resumed)
  hang             a rank stops in epoch 2 (the watchdog ends the launch; the retry resumes)
  mlflow_restart   the MLflow server is killed once that run has trained an epoch, and started
                   again 10 s later
  prefect_restart  the same for the Prefect server
  corrupt_image    a file that is not an image is added to the data before the run
  bad_parameter    the run asks for epochs=0 (the server refuses to create it, naming the
                   field: the deployment's parameter schema)
  fresh_home       the run and 3 more start at the same moment on an empty home of their own
                   (a new worker after a deploy): the pool runs 4 at once for them

Then the audit: every run final; every completed run has exactly one model version, with its
files; every failed run failed with a named cause (and only the runs meant to fail); the
champion passed the gate; no rank, flow-run process, server, port, held lock or temporary file
left; both databases pass SQLite's integrity check. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import fcntl
import io
import json
import os
import random
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from commands import services
from training.processes import alive, free_port, port_in_use

REPO = Path(__file__).resolve().parents[1]
KINDS = ("kill_rank", "preempt", "hang", "mlflow_restart", "prefect_restart", "corrupt_image",
         "bad_parameter", "fresh_home")
FRESH_RUNS = 4
"""First runs started together on one fresh home by the fresh_home fault."""
MODEL = "soak-digits"
TRAINING = {"epochs": 3, "image_size": 12, "batch_size": 50, "num_processes": 2,
            "heartbeat_steps": 1, "hang_timeout_s": 20}
RANK_FAULTS = {"kill_rank": "kill:rank=1:epoch=2:step=3",
               "preempt": "preempt:rank=0:epoch=2:step=3",
               "hang": "hang:rank=1:epoch=2:step=2"}


@dataclass
class Run:
    index: int
    fault: str | None
    flow_run_id: str = ""
    state: str = ""
    message: str = ""
    versions: int = 0
    files_ok: bool = False
    home: str | None = None  # fresh_home: the empty home its group starts on

    @property
    def meant_to_fail(self) -> bool:
        return self.fault == "bad_parameter"


def digit_folder(folder: Path) -> Path:
    """The built-in digits as PNG files in one folder per class."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        buffer = io.BytesIO()
        Image.fromarray((pixels * 255 / 16).astype("uint8")).save(buffer, "PNG")
        (folder / str(label)).mkdir(parents=True, exist_ok=True)
        (folder / str(label) / f"{i:04d}.png").write_bytes(buffer.getvalue())
    return folder


class Stack:
    def __init__(self, root: Path):
        self.root, self.folder = root, root / "services"
        self.ports = free_port(), free_port()
        self.extra = {"TRAINFLOW_HOME": str(root / "home"), "PREFECT_HOME": str(root / "prefect"),
                      "PWD": str(REPO)}
        for name, value in self.extra.items():
            if name != "PWD":
                os.environ[name] = value
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
        self.env = self.start()
        os.environ["PREFECT_API_URL"] = self.env["PREFECT_API_URL"]
        os.environ["MLFLOW_TRACKING_URI"] = self.env["MLFLOW_TRACKING_URI"]

    def start(self) -> dict:
        return services.start(self.folder, *self.ports, extra_env=self.extra)

    def pid(self, name: str) -> int:
        return int((self.folder / f"{name}.pid").read_text())

    def restart(self, name: str, down_s: float = 10) -> None:
        pid = self.pid(name)
        os.killpg(pid, 9)  # the server and its own workers, as a crashed host would
        while alive(pid):
            time.sleep(0.1)
        time.sleep(down_s)
        self.start()

    def deploy(self, fresh_homes: bool) -> None:
        """prefect.yaml's digits deployment (2 runs at a time); for fresh homes, one without
        a limit of its own and a pool that runs FRESH_RUNS at once."""
        import subprocess

        prefect = str(services.BIN / "prefect")
        commands = [[prefect, "--no-prompt", "deploy", "--name", "digits"]]
        if fresh_homes:
            commands += [[prefect, "--no-prompt", "deploy", "flows/train_flow.py:train_flow",
                          "--name", "digits-fresh", "--pool", services.POOL],
                         [prefect, "work-pool", "set-concurrency-limit", services.POOL,
                          str(FRESH_RUNS)]]
        for command in commands:
            done = subprocess.run(command, cwd=REPO, env=self.env, capture_output=True,
                                  text=True)
            if done.returncode != 0:
                raise SystemExit(done.stdout[-2000:] + done.stderr[-2000:])


def submit(run: Run, data: Path, root: Path) -> None:
    from prefect.deployments import run_deployment

    env = {"TRAINFLOW_RANK_HOOKS": str(REPO / "tests" / "faults.py")}
    training = dict(TRAINING)
    if run.fault in RANK_FAULTS:
        env |= {"TRAINFLOW_FAULT": RANK_FAULTS[run.fault],
                "TRAINFLOW_FAULT_ONCE": str(root / f"fault-{run.index}")}
    elif run.fault in ("mlflow_restart", "prefect_restart"):
        training["epochs"] = 6  # long enough to be down for 10 s of it
        env["TRAINFLOW_FAULT"] = "slow:step=0.15"
    elif run.fault == "corrupt_image":
        (data / "3" / f"corrupt-{run.index}.png").write_bytes(b"not an image at all")
    elif run.fault == "bad_parameter":
        training["epochs"] = 0
    deployment = "train-flow/digits"
    if run.home:
        env["TRAINFLOW_HOME"], deployment = run.home, "train-flow/digits-fresh"
    from prefect.exceptions import PrefectHTTPStatusError

    try:
        flow_run = run_deployment(deployment, timeout=0, job_variables={"env": env},
                                  parameters={"dataset": {"source": str(data)},
                                              "training": training,
                                              "registry": {"model_name": MODEL}, "force": True})
    except PrefectHTTPStatusError as e:  # the server checks parameters against the schema
        run.state, run.message = "REFUSED", e.response.json().get("detail", str(e))
        return
    run.flow_run_id = str(flow_run.id)


def trained_an_epoch(home: Path, run: Run) -> bool:
    from training.engine.progress import ProgressReader

    folder = home / "runs" / run.flow_run_id / "train"
    return (folder / "progress").exists() and any(
        e.event == "epoch" for e in ProgressReader(folder).poll())


def states(runs: list[Run]) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for run in runs:
            if run.flow_run_id and run.state not in FINAL:
                flow_run = client.read_flow_run(run.flow_run_id)
                run.state = flow_run.state.type.value if flow_run.state else ""
                run.message = (flow_run.state.message or "") if flow_run.state else ""


FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED", "REFUSED"}
"""REFUSED: the Prefect server would not create the run (a parameter outside its schema)."""


def drive(stack: Stack, runs: list[Run], data: Path, interval: float, timeout: float) -> None:
    home = Path(stack.extra["TRAINFLOW_HOME"])
    pending_restarts = [r for r in runs if r.fault in ("mlflow_restart", "prefect_restart")]
    deadline = time.monotonic() + timeout
    next_submit = 0.0
    queue = list(runs)
    while time.monotonic() < deadline:
        if queue and time.monotonic() >= next_submit:
            group = [queue.pop(0)]  # a fresh home's runs go together
            while group[0].home and queue and queue[0].home == group[0].home:
                group.append(queue.pop(0))
            for run in group:
                submit(run, data, stack.root)
                print(f"submitted run {run.index} ({run.fault or 'no fault'}): "
                      f"{run.flow_run_id or run.message}", flush=True)
            next_submit = time.monotonic() + interval
        for run in list(pending_restarts):
            if run.flow_run_id and trained_an_epoch(home, run):
                pending_restarts.remove(run)
                server = "mlflow-server" if run.fault == "mlflow_restart" else "prefect-server"
                print(f"restarting {server} during run {run.index}", flush=True)
                stack.restart(server)
        if not queue and not pending_restarts:
            states(runs)
            if all(r.state in FINAL for r in runs):
                return
        time.sleep(1)
    states(runs)


def audit(stack: Stack, runs: list[Run]) -> dict[str, object]:
    import mlflow
    from mlflow import MlflowClient

    from tasks.lineage import FLOW_RUN_ID
    from tasks.register import PROMOTION

    client = MlflowClient(stack.env["MLFLOW_TRACKING_URI"])
    versions = client.search_model_versions(f"name='{MODEL}'")
    for run in runs:
        mine = [v for v in versions if v.tags.get(FLOW_RUN_ID) == run.flow_run_id]
        run.versions = len(mine)
        if len(mine) == 1:
            with tempfile.TemporaryDirectory() as folder:
                local = Path(mlflow.artifacts.download_artifacts(
                    f"models:/{MODEL}/{mine[0].version}", dst_path=folder,
                    tracking_uri=stack.env["MLFLOW_TRACKING_URI"]))
                run.files_ok = all((local / f).is_file() for f in
                                   ("MLmodel", "artifacts/best.safetensors", "requirements.txt"))
    checks: dict[str, bool] = {}
    checks["every run final"] = all(r.state in FINAL for r in runs)
    completed = [r for r in runs if r.state == "COMPLETED"]
    checks["every completed run: one version, files complete"] = all(
        r.versions == 1 and r.files_ok for r in completed)
    failed = [r for r in runs if r.state != "COMPLETED"]
    checks["every failed run: a named cause"] = all(len(r.message) > 20 for r in failed)
    checks["only the runs meant to fail failed"] = {r.index for r in failed} == {
        r.index for r in runs if r.meant_to_fail}
    checks["no version without a completed run"] = len(versions) == len(completed)
    try:
        champion = client.get_model_version_by_alias(MODEL, "champion")
        checks["the champion passed the gate"] = champion.tags.get(PROMOTION) == "promoted"
    except Exception:
        checks["the champion passed the gate"] = False

    time.sleep(3)
    ours = ("training.train", "training.score", "training.evaluate", "prefect.engine")
    left = [p.pid for p in psutil.process_iter(["cmdline"])
            if any(o in " ".join(p.info["cmdline"] or []) for o in ours)]
    service_pids = [stack.pid(n) for n in ("prefect-server", "mlflow-server", "worker")]
    services.stop(stack.folder)
    time.sleep(1)
    left += [p for p in service_pids if alive(p)]
    left_ports = [p for p in stack.ports if port_in_use(p)]
    home = Path(stack.extra["TRAINFLOW_HOME"])
    homes = [home, *{Path(r.home) for r in runs if r.home}]
    for fresh in homes[1:]:  # one split of the data, each image in it decoded once
        stores = [json.loads(p.read_text()) for p in fresh.glob("splits/*/decoded/*/index.json")]
        checks[f"fresh home {fresh.name}: one split, each image decoded once"] = (
            len(list(fresh.glob("splits/*/*/manifest.csv"))) == 1 and bool(stores)
            and all(s["rows"] == len(s["files"]) for s in stores))
    held_locks = []
    for lock in (lock for h in homes for lock in h.rglob("lock")):
        with open(lock, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                held_locks.append(str(lock))
    temporary = [str(p) for h in homes for p in h.rglob("*.tmp")]
    leftovers = len(left) + len(left_ports) + len(held_locks) + len(temporary)
    checks["no process, port, held lock or temporary file left"] = leftovers == 0
    databases = [Path(stack.extra["PREFECT_HOME"]) / "prefect.db",
                 home / "mlflow-server" / "mlflow.db"]
    integrity = []
    for database in databases:
        with sqlite3.connect(database) as db:
            integrity.append(db.execute("PRAGMA integrity_check").fetchone()[0])
    checks["both databases pass PRAGMA integrity_check"] = integrity == ["ok", "ok"]
    return {"checks": checks, "versions": len(versions), "leftovers": leftovers,
            "left": {"processes": left, "ports": left_ports, "locks": held_locks,
                     "temporary": temporary}}


def with_fresh_homes(runs: list[Run], root: Path) -> list[Run]:
    """Each fresh_home run followed by the other first runs of its group, all on one new home;
    numbered again in order."""
    expanded = []
    for run in runs:
        if run.fault == "fresh_home":
            home = str(root / f"fresh-home-{run.index}")
            expanded += [Run(0, "fresh_home", home=home) for _ in range(FRESH_RUNS)]
        else:
            expanded.append(run)
    for index, run in enumerate(expanded):
        run.index = index
    return expanded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--faults", type=int, default=10, help="how many runs get a fault")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="the fault kinds to cycle through, comma-separated")
    parser.add_argument("--interval", type=float, default=5, help="seconds between submissions")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    rng = random.Random(args.seed)
    chosen = sorted(rng.sample(range(args.runs), min(args.faults, args.runs)))
    order = list(kinds)
    rng.shuffle(order)
    runs = [Run(i, None) for i in range(args.runs)]
    for n, i in enumerate(chosen):
        runs[i].fault = order[n % len(order)]
    root = Path(tempfile.mkdtemp(prefix="trainflow-soak-"))
    runs = with_fresh_homes(runs, root)

    started = time.monotonic()
    stack = Stack(root)
    try:
        stack.deploy(any(r.home for r in runs))
        data = digit_folder(root / "digits")
        drive(stack, runs, data, args.interval, args.timeout)
        report = audit(stack, runs)
    finally:
        services.stop(stack.folder)
    minutes = (time.monotonic() - started) / 60

    print("\n| run | fault | state | versions | cause (failed runs) |\n|---|---|---|---|---|")
    for r in runs:
        cause = r.message[:90].replace("|", "/") if r.state != "COMPLETED" else ""
        print(f"| {r.index} | {r.fault or '-'} | {r.state} | {r.versions} | {cause} |")
    by_kind = {k: sum(r.fault == k for r in runs) for k in kinds}
    recovered = sum(r.fault is not None and not r.meant_to_fail and r.state == "COMPLETED"
                    for r in runs)
    print(f"\nruns {len(runs)}, faults {sum(by_kind.values())} "
          f"({', '.join(f'{k} {n}' for k, n in by_kind.items() if n)}), recovered {recovered} "
          f"of {sum(r.fault is not None and not r.meant_to_fail for r in runs)}, completed "
          f"{sum(r.state == 'COMPLETED' for r in runs)}, versions {report['versions']}, "
          f"leftovers {report['leftovers']}, {minutes:.1f} min")
    for check, passed in report["checks"].items():
        print(f"  {'ok  ' if passed else 'FAIL'} {check}")
    if report["leftovers"]:
        print(f"left: {report['left']}")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
