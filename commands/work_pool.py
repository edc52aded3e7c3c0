"""A work pool for the project's flows, and the automations that keep its runs from being lost.

    trainflow work-pool create train-k8s --type kubernetes \\
        --base-job-template deploy/kubernetes/base-job-template.json

`trainflow services start` (both stacks) creates its process pool the same way.

A machine that disappears (power, a kernel panic, a node scaled away) leaves no process to report
its flow runs, and Prefect shows them Running for ever. Prefect's own answer, configured here:
every flow run emits a heartbeat event each `HEARTBEAT_S` seconds (the setting is in the pool's
environment and the worker's), and an automation marks Crashed a deployment run of ours whose
heartbeats stop for `LOST_AFTER_S`. A second automation schedules a crashed run again, at most
`RESTARTS` times, so that a worker elsewhere picks it up; it is the same flow run, so it resumes
from its last checkpoint and keeps its place in MLflow. Both are found by name: one that
reads the same is kept, a changed one replaced.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

BIN = Path(sys.executable).parent
HEARTBEAT_S = 30
"""Prefect's shortest heartbeat interval (its default is 180 s)."""
LOST_AFTER_S = 3 * HEARTBEAT_S
"""Three heartbeats missed in a row: a loaded machine is late by seconds, not by a minute."""
RESTARTS = 2
"""How often a lost run is scheduled again; a run lost a third time stays Crashed for a person."""
FLOWS = ["train-flow", "predict-flow", "sweep-flow", "train-node"]
HEARTBEAT_ENV = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)}
LOST_RUNS = "trainflow: crash runs whose heartbeats stopped"
RETRY_LOST = "trainflow: schedule crashed runs again"
ENDED = ["Completed", "Failed", "Cancelled", "Crashed", "Suspended"]


def _ours():
    """Deployment runs of the project's flows: a flow run started by hand has no worker to
    pick it up again, and other teams' flows on the same server keep their own rules."""
    return [{"prefect.resource.role": "deployment"},
            {"prefect.resource.role": "flow", "prefect.resource.name": FLOWS}]


def automations():
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    runs = {"prefect.resource.id": "prefect.flow-run.*"}
    lost = Automation(
        name=LOST_RUNS,
        description=f"A deployment run of {', '.join(FLOWS)} that sent no heartbeat for "
        f"{LOST_AFTER_S} s lost its machine: mark it Crashed (Prefect's zombie-flow recipe).",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in ENDED)},
            match=runs, match_related=_ours(), for_each={"prefect.resource.id"},
            posture=Posture.Proactive, threshold=1, within=timedelta(seconds=LOST_AFTER_S)),
        actions=[ChangeFlowRunState(
            state=StateType.CRASHED,
            message=f"No heartbeat for {LOST_AFTER_S} s: its machine or process was lost.")])
    retry = Automation(
        name=RETRY_LOST,
        description=f"A crashed deployment run of {', '.join(FLOWS)} is scheduled again for "
        f"a worker, at most {RESTARTS} times; it resumes from its last checkpoint.",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            # The run count is the crashed execution's: 1 and 2 are the first two.
            match={**runs, "prefect.run-count": [str(n) for n in range(1, RESTARTS + 1)]},
            match_related=_ours(), posture=Posture.Reactive, threshold=1,
            within=timedelta(0)),
        actions=[ChangeFlowRunState(
            state=StateType.SCHEDULED, name="AwaitingRetry", force=True,
            message="Crashed: scheduled again for a worker (trainflow's retry of lost runs).")])
    return [lost, retry]


def _definition(automation) -> str:
    """What an automation does, comparable across processes: its sets (serialized in each
    process's hash order) sorted."""
    return json.dumps(_sorted(automation.model_dump(
        mode="json", include={"description", "trigger", "actions", "enabled"},
        exclude={"trigger": {"id"}})), sort_keys=True)


def _sorted(value):
    if isinstance(value, dict):
        return {k: _sorted(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [_sorted(v) for v in value]
        return sorted(items) if all(isinstance(v, str) for v in items) else items
    return value


def install_automations(made: list | None = None) -> list[str]:
    """Create `made` (the lost-run automations by default) on the server of this process's
    Prefect settings; their names.

    One left as it is when it already reads the same: a proactive trigger keeps what it has
    seen in its automation, so a copy made anew on a restart of the services would forget the
    heartbeats of runs already going, and never crash them. A changed one is replaced.
    """
    from prefect.client.orchestration import get_client

    made = automations() if made is None else made
    with get_client(sync_client=True) as client:
        for automation in made:
            found = client.read_automations_by_name(automation.name)
            if [_definition(a) for a in found] == [_definition(automation)]:
                continue
            for old in found:
                client.delete_automation(old.id)
            automation.create()
    return [automation.name for automation in made]


def create(pool: str, env: dict[str, str], kind: str = "process", limit: int | None = None,
           base_job_template: Path | None = None) -> None:
    """Create (or update) `pool` and the lost-run automations on `env`'s server."""
    command = [str(BIN / "prefect"), "work-pool", "create", pool, "--type", kind, "--overwrite"]
    if base_job_template is not None:
        command += ["--base-job-template", str(base_job_template)]
    elif kind == "process":
        command += ["--base-job-template", str(_process_template(env, pool))]
    subprocess.run(command, env=env, check=True, capture_output=True)
    if limit is not None:
        subprocess.run([str(BIN / "prefect"), "work-pool", "set-concurrency-limit", pool,
                        str(limit)], env=env, check=True, capture_output=True)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        install_automations()


def _process_template(env: dict[str, str], pool: str) -> Path:
    """Prefect's process template with the heartbeat in its default environment, so that a
    worker started without it still beats at the interval the automation expects."""
    done = subprocess.run([str(BIN / "prefect"), "work-pool", "get-default-base-job-template",
                           "--type", "process"], env=env, check=True, capture_output=True,
                          text=True)
    template = json.loads(done.stdout)
    env_variable = template["variables"]["properties"]["env"]
    env_variable["default"] = {**(env_variable.get("default") or {}), **HEARTBEAT_ENV}
    path = Path(env.get("PREFECT_HOME", Path.home() / ".prefect")) / f"{pool}-template.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(template, indent=2))
    return path


def main(argv: list[str] | None = None) -> None:
    import os

    parser = argparse.ArgumentParser(
        prog="trainflow work-pool", description="Create a work pool with the automations that "
        "crash and retry runs whose machine was lost (heartbeats every "
        f"{HEARTBEAT_S} s, lost after {LOST_AFTER_S} s, {RESTARTS} retries).")
    parser.add_argument("action", choices=["create"])
    parser.add_argument("name")
    parser.add_argument("--type", default="process", help="process, kubernetes, ...")
    parser.add_argument("--base-job-template", type=Path,
                        help="e.g. deploy/kubernetes/base-job-template.json")
    parser.add_argument("--concurrency-limit", type=int)
    args = parser.parse_args(argv)
    if not os.environ.get("PREFECT_API_URL"):
        sys.exit("trainflow work-pool: PREFECT_API_URL is not set; export the server's URL "
                 "(e.g. http://127.0.0.1:4200/api) and run it again")
    create(args.name, dict(os.environ), args.type, args.concurrency_limit, args.base_job_template)
    print(f"work pool {args.name!r} ({args.type}) with the automations {LOST_RUNS!r} and "
          f"{RETRY_LOST!r}; its flow runs need {HEARTBEAT_ENV} in their environment")
