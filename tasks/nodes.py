"""One training on several machines: one `train-node` flow run per machine, joined by c10d.

Prefect places the nodes: each node's run goes to its own work queue (`machine-<rank>` by
default) and each machine runs a worker that polls only its queue, so no two nodes share a
machine and nothing here schedules anything. Machine 0 reports the address the others must
reach (a table artifact on its run); the train task then starts the others, reads every
rank's events from the shared run folder exactly as on one machine, and cancels every node
when one fails, so that a retry starts them all again from the last checkpoint.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse
from uuid import UUID

from prefect import get_client, task
from prefect.artifacts import create_table_artifact
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_API_URL
from prefect.states import Cancelling

from runtime.launcher import LaunchFailed, Watchdog, describe, failure, launch, rank_errors
from runtime.network import (
    address_towards,
    check_main_address,
    rendezvous_env,
    wait_reachable,
)
from tasks import run_logger
from tasks.preflight import NodesUnavailable, check_training, check_workers
from training.config import TrainingSpec
from training.engine.events import Event, Started
from training.engine.progress import ProgressReader
from training.handoff import TrainJob
from training.processes import free_port

RENDEZVOUS = "rendezvous: the address of machine 0"
POLL_S = 1.0
# A node's flow run starts a fresh interpreter, imports torch and only then launches.
NODE_STARTUP_S = 180.0


# --- the train task's side -------------------------------------------------------------------

def launch_nodes(spec: TrainingSpec, job_file: Path, output_dir: Path, resume: bool, logger,
                 on_event: Callable[[Event], None]) -> list[Event]:
    """Start a node per machine, wait for all, return every rank's events (like `launch`)."""
    reader = ProgressReader(output_dir)
    reader.skip_existing()
    runs: dict[int, UUID] = {}
    with get_client(sync_client=True) as client:
        check_workers(client, spec)
        try:
            # All at once: the others start their interpreters while machine 0 finds its
            # address, then read it from machine 0's run.
            runs[0] = submit(spec, job_file, 0, resume)
            for rank in range(1, spec.num_machines):
                runs[rank] = submit(spec, job_file, rank, resume, machine_0_run=runs[0])
            return watch(client, runs, reader, spec, on_event)
        finally:
            cancel_unfinished(client, runs, logger)


def submit(spec: TrainingSpec, job_file: Path, rank: int, resume: bool,
           machine_0_run: UUID | None = None) -> UUID:
    run = run_deployment(
        spec.node_deployment, timeout=0, work_queue_name=spec.node_queue(rank),
        parameters={"job_file": str(job_file), "machine_rank": rank, "resume": resume,
                    "machine_0_run": str(machine_0_run) if machine_0_run else None})
    return run.id


def wait_for_address(client, run_id: UUID | str, spec: TrainingSpec) -> tuple[str, int]:
    """Machine 0's address, from the artifact its run publishes (a configured one wins)."""
    if spec.main_process_ip and spec.main_process_port:
        return spec.main_process_ip, spec.main_process_port
    deadline = time.monotonic() + NODE_STARTUP_S + spec.rendezvous_timeout_s
    only_it = FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
    while time.monotonic() < deadline:
        for artifact in client.read_artifacts(flow_run_filter=only_it):
            if artifact.description == RENDEZVOUS:
                [row] = json.loads(artifact.data)
                return row["address"], int(row["port"])
        state = client.read_flow_run(run_id).state
        if state is not None and state.is_final():
            raise LaunchFailed(f"machine 0 ended {state.name} before it started: "
                               f"{state.message}")
        time.sleep(POLL_S)
    raise NodesUnavailable(
        f"machine 0 did not start within {NODE_STARTUP_S + spec.rendezvous_timeout_s:g} s: no "
        f"worker took its run from work queue {spec.node_queue(0)!r}")


def watch(client, runs: dict[int, UUID], reader: ProgressReader, spec: TrainingSpec,
          on_event: Callable[[Event], None]) -> list[Event]:
    """Every rank's events as they come; the first node to fail fails the training."""
    events: list[Event] = []
    last_seen: dict[int, Event] = {}
    dog = Watchdog(spec.hang_timeout_s, NODE_STARTUP_S + spec.rendezvous_timeout_s,
                   spec.timeout_s)

    def read_events() -> None:
        for event in reader.poll():
            events.append(event)
            last_seen[event.rank] = event
            dog.progress()
            on_event(event)

    while True:
        read_events()
        states = {rank: client.read_flow_run(run_id).state for rank, run_id in runs.items()}
        for rank, state in sorted(states.items()):
            if state is not None and state.is_final() and not state.is_completed():
                ranks, traceback = failure(1, events) if rank_errors(events) else ("", None)
                raise LaunchFailed(f"machine {rank} ended {state.name}: {state.message}"
                                   + (f"; {ranks}" if ranks else ""), traceback)
        if all(state is not None and state.is_completed() for state in states.values()):
            read_events()
            return events
        dog.check(lambda: describe(last_seen))
        time.sleep(POLL_S)


def cancel_unfinished(client, runs: dict[int, UUID], logger) -> None:
    """The workers stop what is still running; no node outlives the train task's attempt."""
    for rank, run_id in runs.items():
        state = client.read_flow_run(run_id).state
        if state is None or not state.is_final():
            logger.info("cancelling machine %d's run", rank)
            client.set_flow_run_state(run_id, Cancelling(), force=True)


# --- each machine's side ---------------------------------------------------------------------

def read_job(job_file: Path, machine_rank: int) -> TrainJob:
    """The job, or a clear error when this machine does not see the shared run folder."""
    where = f"machine {machine_rank} ({socket.gethostname()})"
    if not job_file.exists():
        raise FileNotFoundError(
            f"{where} cannot see the job file {job_file}: every machine must mount the run "
            "folder (TRAINFLOW_HOME) at the same path; see docs/multi-machine.md")
    job = TrainJob.load(job_file)
    for needed in (job.split.manifest, job.split.root):
        if not Path(needed).exists():
            raise FileNotFoundError(f"{where} cannot see {needed}: the dataset and its "
                                    "manifest must be on storage every machine mounts")
    return job


def api_host() -> str:
    return urlparse(PREFECT_API_URL.value() or "http://127.0.0.1").hostname or "127.0.0.1"


@task(task_run_name="machine-{machine_rank}")
def launch_node(job_file: Path, machine_rank: int, resume: bool,
                machine_0_run: str | None) -> int:
    """This machine's `accelerate launch`; returns how many ranks started here."""
    logger = run_logger()
    job = read_job(job_file, machine_rank)
    spec = job.training
    # The GPUs that matter are this machine's: checked here, before the rendezvous, so a node
    # that cannot train fails alone and by name instead of leaving the others waiting.
    check_training(spec.on_this_machine())
    if machine_rank == 0:
        # The address on the route to the Prefect server: a network every worker reaches.
        address = spec.main_process_ip or address_towards(api_host())
        port = spec.main_process_port or free_port(address)
        check_main_address(address, port)
        create_table_artifact([{"address": address, "port": port}], description=RENDEZVOUS)
        local = address
    else:
        with get_client(sync_client=True) as client:
            address, port = wait_for_address(client, machine_0_run, spec)
        wait_reachable(address, port, spec.rendezvous_timeout_s)
        local = address_towards(address)
    logger.info("machine %d at %s joins the rendezvous at %s:%s", machine_rank, local, address,
                port)
    node = spec.model_copy(update={"machine_rank": machine_rank, "main_process_ip": address,
                                   "main_process_port": port})
    here = []

    def on_event(event: Event) -> None:
        if isinstance(event, Started) and event.address == local:
            here.append(event.rank)

    args = ["--job", str(job_file)] + (["--resume"] if resume else [])
    launch(node, "training.train", args, job.output_dir, logger, on_event, rendezvous_env(local))
    return len(here)
