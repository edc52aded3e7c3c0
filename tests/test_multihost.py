"""One flow run trains across two real network hosts (namespaces), placed by Prefect workers.

The flow runs here, in the root namespace, like a train-flow run on any worker; each host's
worker takes its own node's flow run from its own work queue; the ranks rendezvous over the
virtual link with c10d. The hosts share the home folder, as a cluster's shared mount would,
except in the object-store test: there each machine has a home of its own, the others' are out
of its sight, and what they share goes through TRAINFLOW_REMOTE_ROOT on a real S3 server
(moto's). Skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.hosts import namespaces_possible, two_hosts
from training.engine.progress import ProgressReader
from training.processes import kill_tree

WHY_NOT = namespaces_possible()
pytestmark = [pytest.mark.slow, pytest.mark.multihost,
              pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]
# Slow steps (0.2 s each) make an epoch last seconds, so a node can be killed mid-epoch.
TWO_HOSTS = {"epochs": 3, "image_size": 12, "batch_size": 32, "num_processes": 2,
             "num_machines": 2, "hang_timeout_s": 60, "rendezvous_timeout_s": 60}


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hosts")
    home = folder / "home"
    with two_hosts(folder, {"TRAINFLOW_HOME": str(home), "TRAINFLOW_FAULT": "slow:step=0.2",
                            "OMP_NUM_THREADS": "1"}) as made:
        made.env["TRAINFLOW_HOME"] = str(home)
        yield made


@pytest.fixture(scope="module")
def flow_worker(hosts, tmp_path_factory):
    """train-flow/digits deployed to the same pool, and a worker for it outside both hosts, as
    a user's train-flow run would run on some machine of the pool."""
    from tests.hosts import BIN, REPO

    done = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--name", "digits",
                           "--pool", hosts.pool], cwd=REPO, env=hosts.env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    log = tmp_path_factory.mktemp("flow-worker") / "worker.log"
    with open(log, "ab") as out:
        worker = subprocess.Popen(
            [str(BIN / "prefect"), "worker", "start", "--pool", hosts.pool, "--work-queue",
             "default", "--type", "process"], env=hosts.env, cwd=REPO, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield worker
    finally:
        kill_tree(worker)


@pytest.fixture
def on_hosts(hosts, monkeypatch):
    """This test's flow talks to the hosts' Prefect server and shares their home folder."""
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.setenv("TRAINFLOW_HOME", hosts.env["TRAINFLOW_HOME"])
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # Prefect's events worker is one per process, bound to the first server it meets: one made
    # for the hosts' server would send later tests' events to it once it is gone (70 s each).
    EventsWorker.drain_all(timeout=60)
    with temporary_settings({PREFECT_API_URL: hosts.api}):
        try:
            yield hosts
        finally:
            EventsWorker.drain_all(timeout=60)


def _node_runs(hosts):
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("train-node/nodes")
        return client.read_flow_runs(deployment_filter=DeploymentFilter(
            id=DeploymentFilterId(any_=[deployment.id])))


def _training_processes(hosts) -> list[int]:
    left = []
    for host in range(len(hosts.names)):
        for pid in hosts.pids(host):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"training.train" in cmdline or b"accelerate.commands.launch" in cmdline:
                left.append(pid)
    return left


def test_one_flow_run_trains_on_two_hosts_and_a_killed_node_resumes_on_both(on_hosts):
    from mlflow import MlflowClient

    from flows.train_flow import train_flow
    from training.storage import home, tracking_uri

    hosts = on_hosts
    received_before = hosts.received_bytes(1)
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = train_flow(dataset={"source": "builtin:digits"},
                                           training=TWO_HOSTS, force=True,
                                           registry={"model_name": "two-hosts"})
        except BaseException as e:
            outcome["error"] = e

    # The thread runs in this context: Prefect's settings (the hosts' server) are context vars.
    flow = threading.Thread(target=contextvars.copy_context().run, args=(run,))
    flow.start()
    killed = None
    deadline = time.monotonic() + 400
    while killed is None and flow.is_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
        for progress in (home() / "runs").glob("*/train/progress/rank0.jsonl"):
            events = ProgressReader(progress.parent.parent).poll()
            if any(e.event == "epoch" and e.epoch == 1 for e in events):
                killed, killed_at = hosts.kill_launch(1), time.time()  # in epoch 2
                break
    assert killed, "the training never finished its first epoch on two hosts"
    flow.join(600)
    assert "error" not in outcome, repr(outcome.get("error"))
    result = outcome["result"]

    assert result.trained.world_size == 4
    events = ProgressReader(result.trained.job.output_dir).poll()
    resumed = [e for e in events if e.event == "resumed"]
    assert resumed and resumed[-1].epoch >= 1  # the retry went on from a checkpoint
    retried = Counter(e.address for e in events if e.event == "start"
                      and e.time > killed_at)  # two ranks on each host, again
    assert retried == Counter({hosts.addresses[0]: 2, hosts.addresses[1]: 2}), retried
    assert hosts.received_bytes(1) - received_before > 100_000  # gradients crossed the link

    client = MlflowClient(tracking_uri())
    assert [str(v.version) for v in client.search_model_versions("name='two-hosts'")] == ["1"]
    assert result.registration.version == "1"
    node_states = Counter(r.state.type.value for r in _node_runs(hosts))
    assert node_states["COMPLETED"] == 2 and sum(node_states.values()) == 4, node_states
    deadline = time.monotonic() + 30
    while _training_processes(hosts) and time.monotonic() < deadline:
        time.sleep(1)
    assert _training_processes(hosts) == []


def test_more_machines_than_workers_is_refused_before_any_work(on_hosts):
    from flows.train_flow import train_flow
    from tasks.preflight import PreflightError

    with pytest.raises(PreflightError, match=r"none polls \['machine-2'\]"):
        train_flow(dataset={"source": "builtin:digits"},
                   training={**TWO_HOSTS, "num_machines": 3}, force=True)


@pytest.mark.extended
@pytest.mark.timeout(400)  # a hang guard: two attempts, not torch's 600 s rendezvous timeouts
def test_a_taken_port_on_machine_0_fails_in_seconds_with_its_reason(on_hosts):
    from flows.train_flow import train_flow

    hosts = on_hosts
    port = 29555
    listener = subprocess.Popen(
        ["ip", "netns", "exec", hosts.names[0], "python3", "-c",
         f"import socket,time; s=socket.socket(); s.bind(('0.0.0.0', {port})); s.listen(); "
         "time.sleep(600)"])
    try:
        time.sleep(1)
        with pytest.raises(Exception, match=f"port {port} on machine 0 .* is taken"):
            train_flow(dataset={"source": "builtin:digits"}, force=True,
                       training={**TWO_HOSTS, "main_process_port": port})
    finally:
        listener.kill()


def test_machine_0_that_is_not_there_is_named(on_hosts):
    from runtime.network import NetworkProblem, wait_reachable

    hosts = on_hosts
    nobody = hosts.addresses[0].rsplit(".", 1)[0] + ".250"
    with pytest.raises(NetworkProblem, match=f"machine 0 at {nobody}:29500 cannot be reached"):
        wait_reachable(nobody, 29500, timeout_s=5)
    with socket.socket() as s:
        s.bind((hosts.gateway, 0))  # an address that answers, with nobody listening yet
        s.listen()
        wait_reachable(hosts.gateway, s.getsockname()[1], timeout_s=5)


@pytest.mark.extended
def test_cancelling_the_flow_run_stops_every_node_on_every_host(on_hosts, flow_worker):
    from prefect import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    from training.storage import home

    hosts = on_hosts
    run = run_deployment("train-flow/digits", timeout=0, parameters={
        "training": {**TWO_HOSTS, "epochs": 30}, "force": True})
    progress = home() / "runs" / str(run.id) / "train"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and not any(
            e.event == "epoch" for e in ProgressReader(progress).poll()):
        time.sleep(0.5)
    assert _training_processes(hosts), "the training never got going on the hosts"
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Cancelling())
        cancelled = time.monotonic()
        while _training_processes(hosts) and time.monotonic() - cancelled < 90:
            time.sleep(1)
        stopped_after = time.monotonic() - cancelled
        assert _training_processes(hosts) == [], "ranks outlived the cancelled flow run"
        while time.monotonic() - cancelled < 120 and not client.read_flow_run(
                run.id).state.is_final():
            time.sleep(1)
        assert client.read_flow_run(run.id).state.type.value == "CANCELLED"
    # Each host's worker marks its own node run Cancelled on its next cancellation poll.
    deadline = time.monotonic() + 60
    while True:
        nodes = [r for r in _node_runs(hosts)
                 if str(run.id) in str(r.parameters.get("run_folder"))]
        if all(r.state.is_final() for r in nodes) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert len(nodes) == 2 and all(r.state.is_final() for r in nodes), nodes
    print(f"every rank on both hosts gone {stopped_after:.0f} s after the cancel")


S3_KEYS = {"AWS_ACCESS_KEY_ID": "hosts-key-id-4711", "AWS_SECRET_ACCESS_KEY": "hosts-secret-0815",
           "AWS_DEFAULT_REGION": "us-east-1"}
REMOTE_ROOT = "s3://team/trainflow"


@pytest.fixture
def bucket(tmp_path):
    """moto's S3 server on every address, so that the hosts reach it at the bridge's."""
    from tests.servers import BIN, started
    from training.processes import free_port

    port = free_port()
    server = [str(BIN / "python"), "-m", "moto.server", "-H", "0.0.0.0", "-p", str(port)]
    with started(server, f"http://127.0.0.1:{port}/moto-api/", tmp_path / "s3.log"):
        import boto3

        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                          aws_access_key_id=S3_KEYS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=S3_KEYS["AWS_SECRET_ACCESS_KEY"])
        s3.create_bucket(Bucket="team")
        yield s3, port


def test_two_hosts_with_no_shared_folder_train_evaluate_and_register_through_the_bucket(
        on_hosts, bucket, tmp_path, monkeypatch):
    """Machine 0 is the flow's own launch here, with its own home; machine 1's worker, on host
    1, has another home and sees neither this one nor the shared one. Machine 1 is killed
    mid-epoch: the retry resumes it from the checkpoint it fetched from the bucket."""
    from mlflow import MlflowClient
    from prefect import get_client

    from flows.train_flow import train_flow
    from runtime.remote import save_result_storage
    from tests.hosts import wait_ready
    from training.storage import tracking_uri

    hosts, (s3, port) = on_hosts, bucket
    homes = [tmp_path / "home-0", tmp_path / "home-1"]
    for home in homes:
        home.mkdir()
    worker = hosts.start_worker(1, "remote-1", env={
        **S3_KEYS, "TRAINFLOW_REMOTE_ROOT": REMOTE_ROOT, "TRAINFLOW_HOME": str(homes[1]),
        "AWS_ENDPOINT_URL_S3": f"http://{hosts.gateway}:{port}"},
        hidden=[homes[0], Path(hosts.env["TRAINFLOW_HOME"])])
    for name, value in {**S3_KEYS, "TRAINFLOW_REMOTE_ROOT": REMOTE_ROOT,
                        "TRAINFLOW_HOME": str(homes[0]),
                        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}.items():
        monkeypatch.setenv(name, value)
    save_result_storage()  # as a caller running train_flow in its own process does
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = train_flow(
                dataset={"source": "builtin:digits"}, force=True,
                training={**TWO_HOSTS, "node_work_queue": "remote-{machine_rank}"},
                registry={"model_name": "remote-hosts"})
        except BaseException as e:
            outcome["error"] = e

    try:
        wait_ready(hosts, ["remote-1"])
        flow = threading.Thread(target=contextvars.copy_context().run, args=(run,))
        flow.start()
        killed, deadline = None, time.monotonic() + 400
        while killed is None and flow.is_alive() and time.monotonic() < deadline:
            time.sleep(0.5)
            for progress in (homes[0] / "runs").glob("*/train/progress/rank0.jsonl"):
                if any(e.event == "epoch" and e.epoch == 1
                       for e in ProgressReader(progress.parent.parent).poll()):
                    killed = hosts.kill_launch(1)  # in epoch 2
                    break
        assert killed, "the training never finished its first epoch on two hosts"
        flow.join(600)
        assert "error" not in outcome, repr(outcome.get("error"))
        result = outcome["result"]
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs()
            logs = _all_logs(client)
    finally:
        kill_tree(worker)

    assert result.trained.world_size == 4
    assert result.evaluation.images > 0 and result.registration.version == "1"
    assert [str(v.version) for v in MlflowClient(tracking_uri()).search_model_versions(
        "name='remote-hosts'")] == ["1"]
    run = result.trained.job.output_dir.relative_to(homes[0])
    # Machine 1's ranks ran on host 1, twice, from its own copy of the job and the data; the
    # retry resumed them from the checkpoint fetched: host 1's disk had no weights of its own.
    there = ProgressReader(homes[1] / run).poll()
    assert Counter(e.address for e in there if e.event == "start") == Counter(
        {hosts.addresses[1]: 4})
    resumed = [e for e in there if e.event == "resumed"]
    assert resumed and resumed[-1].epoch >= 1, there
    assert "fetched checkpoint(s)" in (hosts.folder / "worker-remote-1.log").read_text()

    # Host 1's home holds its local copies only: the fetched split and its run folder.
    assert sorted(p.name for p in homes[1].iterdir() if not p.name.startswith(".")) == [
        "fetched", "runs"]
    assert not list(homes[1].rglob("*.png")) and not list(homes[1].rglob("best.safetensors"))
    assert list(homes[1].glob("fetched/*/decoded/*/images.u8"))

    # The bucket: one manifest, each store as one object and its index, and machine 0's newest
    # two complete checkpoints.
    objects = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="team")
               for o in page.get("Contents", [])]
    kinds = Counter(key.split("/")[1] for key in objects)
    assert len({key.split("/")[2] for key in objects if "/splits/" in key}) == 1, objects
    assert kinds["stores"] % 2 == 0 and kinds["stores"] >= 2, objects
    complete = sorted(key.split("/")[-2] for key in objects
                      if "/checkpoints/" in key and key.endswith("/trainer_state.json"))
    assert complete == ["checkpoint_2", "checkpoint_3"], objects

    # The S3 keys are in no object, parameter, log line or worker log.
    secret = S3_KEYS["AWS_SECRET_ACCESS_KEY"]
    for key in objects:
        assert secret.encode() not in s3.get_object(Bucket="team", Key=key)["Body"].read(), key
    assert secret not in json.dumps([r.parameters for r in runs], default=str)
    assert not [line for line in logs if secret in line]
    for log in hosts.folder.glob("worker-*.log"):
        assert secret not in log.read_text(errors="replace"), log


def _deploy(hosts, name: str) -> None:
    from tests.hosts import BIN, REPO

    done = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--name", name,
                           "--pool", hosts.pool], cwd=REPO, env=hosts.env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _lose(worker: subprocess.Popen) -> None:
    """SIGKILL a worker and everything under it at once: the machine is gone, nothing on it
    reports anything."""
    import psutil

    tree = [psutil.Process(worker.pid), *psutil.Process(worker.pid).children(recursive=True)]
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    worker.wait(timeout=10)


def _all_logs(client, flow_run_id=None) -> list[str]:
    """Every log line (of one flow run), page by page: one read returns 200 at most."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])
                           if flow_run_id else None)
    lines: list[str] = []
    while page := client.read_logs(log_filter=log_filter, offset=len(lines), limit=200,
                                   sort=LogSort.TIMESTAMP_ASC):
        lines += [line.message for line in page]
    return lines


def _bucket_keys(s3) -> list[str]:
    return [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="team")
            for o in page.get("Contents", [])]


@pytest.mark.extended  # minutes of two hosts; CI keeps the two-host bucket run above
def test_a_flow_run_retried_on_the_other_host_resumes_from_the_bucket_and_skips_done_stages(
        on_hosts, bucket, tmp_path):
    """train-flow runs on host 0 (machine 0) with host 1 as machine 1; each host has its own
    disk at one home path. Host 0 is lost mid-training (its worker, the flow process and the
    ranks SIGKILLed); the run is retried and host 1 takes it as machine 0, host 0 coming back as
    machine 1. The retry finds the data stages' results in the bucket, fetches their files,
    resumes from the bucket's checkpoint, and registers once."""
    from mlflow import MlflowClient
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment
    from prefect.states import AwaitingRetry

    from tasks.tracking import experiment_name
    from tests.hosts import wait_ready
    from tests.servers import mlflow_server

    hosts, (s3, port) = on_hosts, bucket
    home = tmp_path / "home"  # the path every host's home is at; each sees its own disk there
    disks = [tmp_path / "disk-0", tmp_path / "disk-1"]
    for folder in (home, *disks):
        folder.mkdir()
    _deploy(hosts, "digits")
    with mlflow_server(tmp_path / "mlflow", host=hosts.gateway) as tracking:
        env = {**S3_KEYS, "TRAINFLOW_REMOTE_ROOT": REMOTE_ROOT, "TRAINFLOW_HOME": str(home),
               "AWS_ENDPOINT_URL_S3": f"http://{hosts.gateway}:{port}",
               "MLFLOW_TRACKING_URI": tracking}

        def worker(host: int, queue: str) -> subprocess.Popen:
            return hosts.start_worker(host, queue, env=env, disk={home: disks[host]},
                                      hidden=[disks[1 - host]])

        workers = [worker(0, "retry-0"), worker(1, "retry-1")]
        try:
            wait_ready(hosts, ["retry-0", "retry-1"])
            run = run_deployment(
                "train-flow/digits", timeout=0, work_queue_name="retry-0", parameters={
                    "training": {**TWO_HOSTS, "epochs": 5,
                                 "node_work_queue": "retry-{machine_rank}"},
                    "registry": {"model_name": "retried-hosts"}, "force": True})
            checkpoints = f"trainflow/runs/{run.id}/train/checkpoints/"
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline and not any(
                    k.startswith(checkpoints) and k.endswith("/trainer_state.json")
                    for k in _bucket_keys(s3)):
                time.sleep(0.5)
            assert time.monotonic() < deadline, "no checkpoint reached the bucket"
            _lose(workers[0])  # mid-training: the flow process, its launch and ranks
            with get_client(sync_client=True) as client:
                assert client.read_flow_run(run.id).state.type.value == "RUNNING"
                # Machine 1's node ends when its peers are gone; host 1 then turns machine 0.
                kill_tree(workers[1])
                workers = [worker(1, "retry-0"), worker(0, "retry-1")]
                wait_ready(hosts, ["retry-0", "retry-1"])
                client.set_flow_run_state(run.id, AwaitingRetry(), force=True)  # UI's Retry
                deadline = time.monotonic() + 400
                while time.monotonic() < deadline and not client.read_flow_run(
                        run.id).state.is_final():
                    time.sleep(2)
                final = client.read_flow_run(run.id)
                tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(
                    id=FlowRunFilterId(any_=[run.id])))
                logs = _all_logs(client, run.id)
                everything = _all_logs(client)
                parameters = json.dumps([r.parameters for r in client.read_flow_runs()],
                                        default=str)
        finally:
            for each in workers:
                kill_tree(each)
        assert final.state.type.value == "COMPLETED", "\n".join([str(final.state), *logs])
        assert final.run_count == 2

        # The data stages and the MLflow run were done once: the retry took their results
        # from the bucket ("Cached") and fetched the dataset and split onto host 1's disk.
        states: dict[str, list[str]] = {}
        for task_run in tasks:
            states.setdefault(task_run.name.rsplit("-", 1)[0], []).append(task_run.state.name)
        for stage in ("prepare_dataset", "split_dataset", "open_mlflow_run"):
            assert sorted(states[stage]) == ["Cached", "Completed"], states
        assert sum(m.startswith("dataset builtin:digits: ") for m in logs) == 1, logs
        assert any("fetched from s3://team/trainflow into" in m and "dataset" in m
                   for m in logs), logs
        assert any(m.startswith("fetched checkpoint(s)") for m in logs), logs
        client = MlflowClient(tracking)
        mlflow_runs = client.search_runs(
            [client.get_experiment_by_name(experiment_name()).experiment_id],
            f"tags.`trainflow.flow_run_id` = '{run.id}'")
        assert len(mlflow_runs) == 1 and mlflow_runs[0].info.status == "FINISHED"
        assert [str(v.version) for v in client.search_model_versions(
            "name='retried-hosts'")] == ["1"]

    # Host 1 trained as machine 0 from the epoch the checkpoint held: not from scratch.
    run_folder = disks[1] / "runs" / str(run.id) / "train"
    events = ProgressReader(run_folder).poll()
    resumed = [e for e in events if e.event == "resumed" and e.rank == 0]
    assert resumed and resumed[-1].epoch >= 1, events
    assert (run_folder / "best.safetensors").exists()
    # Global ranks follow the machine ranks, whatever order the rendezvous met them in.
    assert Counter((e.rank, e.address) for e in events if e.event == "start" and e.rank < 2
                   ) == Counter({(0, hosts.addresses[1]): 1, (1, hosts.addresses[1]): 1})

    # The results in the bucket are JSON, and no object, parameter or log holds the S3 keys.
    objects = _bucket_keys(s3)
    results = [k for k in objects if k.startswith("trainflow/results/")]
    assert results, objects
    secret = S3_KEYS["AWS_SECRET_ACCESS_KEY"]
    for key in objects:
        body = s3.get_object(Bucket="team", Key=key)["Body"].read()
        assert secret.encode() not in body, key
        if key in results:
            json.loads(body)
    assert secret not in parameters
    assert not [m for m in everything if secret in m]
    for log in hosts.folder.glob("worker-retry-*.log"):
        assert secret not in log.read_text(errors="replace"), log
