"""One training on several machines: one `train-node` flow run per machine, joined by c10d.

Prefect places the nodes: each node's run goes to its own work queue (`machine-<rank>` by
default) and each machine runs a worker that polls only its queue, so no two nodes share a
machine and nothing here schedules anything. Machine 0 reports the address the others must
reach (a table artifact on its run); the train task then starts the others, reads every
rank's events from the shared run folder exactly as on one machine, and cancels every node
when one fails, so that a retry starts them all again from the last checkpoint.

With TRAINFLOW_REMOTE_ROOT (runtime/remote.py) no folder is shared: machine 0 is the train
task's own launch, so its best weights, evaluation and events are where the flow runs; the
split's manifest and decode stores are published to the bucket once and each other machine
fetches them before the rendezvous; machine 0's checkpoints are uploaded while it trains and
every machine fetches the newest complete one to resume. The job is the node run's parameter.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
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
from runtime.remote import (
    RemoteRoot,
    RemoteSplit,
    checkpoints_through,
    fetch_checkpoints,
    fetch_split,
    publish_split,
    remote_root,
    run_prefix,
)
from tasks import run_logger
from tasks.preflight import NodesUnavailable, check_training, check_workers
from training.config import TrainingSpec
from training.data.sides import split_sides
from training.engine.events import Event, Started
from training.engine.progress import ProgressReader
from training.handoff import TrainJob
from training.processes import free_port
from training.storage import home

RENDEZVOUS = "rendezvous: the address of machine 0"
POLL_S = 1.0
# A node's flow run starts a fresh interpreter, imports torch and only then launches.
NODE_STARTUP_S = 180.0


# --- the train task's side -------------------------------------------------------------------

def launch_nodes(job: TrainJob, resume: bool, logger,
                 on_event: Callable[[Event], None]) -> list[Event]:
    """Start a node per machine, wait for all, return every rank's events (like `launch`)."""
    remote = remote_root()
    if remote is not None:
        return launch_here_and_on_nodes(job, resume, logger, on_event, remote)
    spec = job.training
    reader = ProgressReader(job.output_dir)
    reader.skip_existing()
    runs: dict[int, UUID] = {}
    with get_client(sync_client=True) as client:
        check_workers(client, spec)
        try:
            # All at once: the others start their interpreters while machine 0 finds its
            # address, then read it from machine 0's run.
            runs[0] = submit(job, 0, resume)
            for rank in range(1, spec.num_machines):
                runs[rank] = submit(job, rank, resume, machine_0_run=runs[0])
            return watch(client, runs, reader, spec, on_event)
        finally:
            cancel_unfinished(client, runs, logger)


def launch_here_and_on_nodes(job: TrainJob, resume: bool, logger,
                             on_event: Callable[[Event], None], remote: RemoteRoot
                             ) -> list[Event]:
    """Machine 0 is this task's own launch; machines 1.. are node runs that fetch what they
    read from the bucket."""
    from prefect.runtime import flow_run

    spec = job.training
    published = publish_split(remote, job.split, split_sides(spec).values())
    logger.info("split published to %s: manifest %s, stores %s", remote,
                published.manifest_sha256[:12], published.stores)
    address, port = machine_0_address(spec)
    create_table_artifact([{"address": address, "port": port}], description=RENDEZVOUS)
    # The address is known before the others start: it travels in their job (a retry of this
    # task makes a new one, which a node reading this run's artifacts could mistake).
    located = job.model_copy(update={"training": spec.model_copy(update={
        "main_process_ip": address, "main_process_port": port})})
    runs: dict[int, UUID] = {}
    with get_client(sync_client=True) as client:
        check_workers(client, spec, first=1)
        try:
            for rank in range(1, spec.num_machines):
                runs[rank] = submit(located, rank, resume, machine_0_run=flow_run.id,
                                    remote_split=published)
            node = located.training.model_copy(update={"machine_rank": 0})
            args = ["--job", str(job.save())] + (["--resume"] if resume else [])
            with checkpoints_through(remote, job, resume, logger):
                events = launch(node, "training.train", args, job.output_dir, logger, on_event,
                                rendezvous_env(address), check=NodeCheck(client, runs))
            wait_completed(client, runs, spec.rendezvous_timeout_s)
            return events
        finally:
            cancel_unfinished(client, runs, logger)


class NodeCheck:
    """Raises when another machine's run ended without completing: this launch stops then,
    instead of waiting on a collective for its lost peers."""

    def __init__(self, client, runs: dict[int, UUID]):
        self.client, self.runs, self.next = client, runs, 0.0

    def __call__(self) -> None:
        if time.monotonic() < self.next:
            return
        self.next = time.monotonic() + POLL_S
        for rank, run_id in sorted(self.runs.items()):
            state = self.client.read_flow_run(run_id).state
            if state is not None and state.is_final() and not state.is_completed():
                raise LaunchFailed(f"machine {rank} ended {state.name}: {state.message}")


def wait_completed(client, runs: dict[int, UUID], timeout_s: float) -> None:
    """The other machines' runs end with machine 0's launch; one that failed fails training."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = {rank: client.read_flow_run(run_id).state for rank, run_id in runs.items()}
        for rank, state in sorted(states.items()):
            if state is not None and state.is_final() and not state.is_completed():
                raise LaunchFailed(f"machine {rank} ended {state.name}: {state.message}")
        if all(state is not None and state.is_completed() for state in states.values()):
            return
        time.sleep(POLL_S)
    raise LaunchFailed(f"machine 0 finished, and the other machines' runs did not end within "
                       f"{timeout_s:g} s")


def machine_0_address(spec: TrainingSpec) -> tuple[str, int]:
    """The address on the route to the Prefect server: a network every worker reaches."""
    address = spec.main_process_ip or address_towards(api_host())
    port = spec.main_process_port or free_port(address)
    check_main_address(address, port)
    return address, port


def submit(job: TrainJob, rank: int, resume: bool, machine_0_run: UUID | None = None,
           remote_split: RemoteSplit | None = None) -> UUID:
    spec = job.training
    run = run_deployment(
        spec.node_deployment, timeout=0, work_queue_name=spec.node_queue(rank),
        parameters={"job": job.model_dump(mode="json"), "machine_rank": rank, "resume": resume,
                    "run_folder": run_prefix(job),
                    "machine_0_run": str(machine_0_run) if machine_0_run else None,
                    "remote_split": remote_split.model_dump() if remote_split else None})
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

def local_job(job: TrainJob, machine_rank: int, folder: str, remote: RemoteRoot | None,
              remote_split: RemoteSplit | None) -> TrainJob:
    """The job with this machine's paths: as given where its files are (a shared mount, or the
    flow's machine), else with the split fetched from the remote root."""
    if job.split.manifest.exists() and job.split.root.exists():
        return job
    where = f"machine {machine_rank} ({socket.gethostname()})"
    if remote is None or remote_split is None:
        raise FileNotFoundError(
            f"{where} cannot see {job.split.manifest}: the dataset and its manifest must be on "
            "storage every machine mounts (TRAINFLOW_HOME at the same path), or every machine "
            "must set TRAINFLOW_REMOTE_ROOT to the same bucket; see docs/multi-machine.md")
    split = fetch_split(remote, job.split, remote_split, home())
    return job.model_copy(update={"split": split, "output_dir": home() / folder})


def api_host() -> str:
    return urlparse(PREFECT_API_URL.value() or "http://127.0.0.1").hostname or "127.0.0.1"


@task(task_run_name="machine-{machine_rank}")
def launch_node(job: TrainJob, machine_rank: int, resume: bool, machine_0_run: str | None,
                folder: str, remote_split: RemoteSplit | None = None) -> int:
    """This machine's `accelerate launch`; returns how many ranks started here."""
    logger = run_logger()
    remote = remote_root() if remote_split is not None else None
    job = local_job(job, machine_rank, folder, remote, remote_split)
    spec = job.training
    # The GPUs that matter are this machine's: checked here, before the rendezvous, so a node
    # that cannot train fails alone and by name instead of leaving the others waiting.
    check_training(spec.on_this_machine())
    if remote is not None and resume:
        fetched = fetch_checkpoints(remote, f"{folder}/checkpoints",
                                    job.output_dir / "checkpoints")
        if fetched:
            logger.info("fetched checkpoint(s) %s from %s", fetched, remote)
    if machine_rank == 0:
        address, port = machine_0_address(spec)
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

    args = ["--job", str(job.save())] + (["--resume"] if resume else [])
    launch(node, "training.train", args, job.output_dir, logger, on_event, rendezvous_env(local))
    return len(here)
