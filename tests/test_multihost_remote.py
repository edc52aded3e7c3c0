"""One flow run trains across two network hosts that share no folder: each has a home of its
own, and what the other host reads goes through TRAINFLOW_REMOTE_ROOT on a real S3 server
(moto's). The flow (machine 0) runs here, in the root namespace, with its own home; host 1's
worker takes machine 1's run. Skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import contextvars
import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.hosts import namespaces_possible, two_hosts
from tests.servers import BIN, started
from training.engine.progress import ProgressReader
from training.processes import free_port

WHY_NOT = namespaces_possible()
pytestmark = [pytest.mark.slow, pytest.mark.multihost,
              pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]
KEYS = {"AWS_ACCESS_KEY_ID": "hosts-key-id-4711", "AWS_SECRET_ACCESS_KEY": "hosts-secret-0815",
        "AWS_DEFAULT_REGION": "us-east-1"}
ROOT = "s3://team/trainflow"
TRAINING = {"epochs": 3, "image_size": 12, "batch_size": 32, "num_processes": 2,
            "num_machines": 2, "hang_timeout_s": 60, "rendezvous_timeout_s": 60}


@pytest.fixture(scope="module")
def remote_hosts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("remote-hosts")
    port = free_port()
    server = [str(BIN / "python"), "-m", "moto.server", "-H", "0.0.0.0", "-p", str(port)]
    with started(server, f"http://127.0.0.1:{port}/moto-api/", folder / "s3.log"):
        import boto3

        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}",
                          region_name="us-east-1", aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"])
        s3.create_bucket(Bucket="team")
        homes = [folder / "home-0", folder / "home-1"]

        def host_env(host: int, gateway: str) -> dict:
            return {"TRAINFLOW_HOME": str(homes[host]),
                    "AWS_ENDPOINT_URL_S3": f"http://{gateway}:{port}"}

        for home in homes:
            home.mkdir()
        with two_hosts(folder, {**KEYS, "TRAINFLOW_REMOTE_ROOT": ROOT, "OMP_NUM_THREADS": "1"},
                       host_env=host_env, hidden=lambda host: [homes[1 - host]]) as hosts:
            yield hosts, homes, s3, port, folder


def test_two_hosts_with_no_shared_folder_train_evaluate_and_register_through_the_bucket(
        remote_hosts, monkeypatch):
    from mlflow import MlflowClient
    from prefect import get_client
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.train_flow import train_flow
    from training.storage import tracking_uri

    hosts, homes, s3, port, folder = remote_hosts
    for name, value in {**KEYS, "TRAINFLOW_REMOTE_ROOT": ROOT, "TRAINFLOW_HOME": str(homes[0]),
                        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    EventsWorker.drain_all(timeout=60)  # tests/test_multihost.py's on_hosts says why
    # Slow steps (0.2 s each) make an epoch last seconds, so machine 1 can be killed mid-epoch.
    monkeypatch.setenv("TRAINFLOW_FAULT", "slow:step=0.2")
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = train_flow(dataset={"source": "builtin:digits"},
                                           training=TRAINING, force=True,
                                           registry={"model_name": "remote-hosts"})
        except BaseException as e:
            outcome["error"] = e

    with temporary_settings({PREFECT_API_URL: hosts.api}):
        try:
            # The thread runs in this context: Prefect's settings are context variables.
            flow = threading.Thread(target=contextvars.copy_context().run, args=(run,))
            flow.start()
            killed, deadline = None, time.monotonic() + 400
            while killed is None and flow.is_alive() and time.monotonic() < deadline:
                time.sleep(0.5)
                for progress in (homes[0] / "runs").glob("*/train/progress/rank0.jsonl"):
                    events = ProgressReader(progress.parent.parent).poll()
                    if any(e.event == "epoch" and e.epoch == 1 for e in events):
                        killed = hosts.kill_launch(1)  # in epoch 2
                        break
            assert killed, "the training never finished its first epoch on two hosts"
            flow.join(600)
            assert "error" not in outcome, repr(outcome.get("error"))
            result = outcome["result"]
            with get_client(sync_client=True) as client:
                runs = client.read_flow_runs()
                logs = client.read_logs()
        finally:
            EventsWorker.drain_all(timeout=60)

    assert result.trained.world_size == 4
    assert result.evaluation.images > 0 and result.registration.version == "1"
    assert [str(v.version) for v in MlflowClient(tracking_uri()).search_model_versions(
        "name='remote-hosts'")] == ["1"]
    run = result.trained.job.output_dir.relative_to(homes[0])
    # Machine 1's ranks ran on host 1, from host 1's own copy of the job and the data.
    there = ProgressReader(homes[1] / run).poll()
    assert Counter(e.address for e in there if e.event == "start") == Counter(
        {hosts.addresses[1]: 4})  # two ranks, twice
    # The retry resumed machine 1 from the checkpoint it fetched: its own disk had no weights.
    resumed = [e for e in there if e.event == "resumed"]
    assert resumed and resumed[-1].epoch >= 1, there
    assert "fetched checkpoint(s)" in (folder / "worker-1.log").read_text()

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
    assert kinds["splits"] == 1 and kinds["stores"] % 2 == 0 and kinds["stores"] >= 2, objects
    checkpoints = sorted({key.split("/")[-2] for key in objects if
                          key.endswith("/checkpoints/" + key.split("/")[-2] + "/trainer_state.json")})
    assert checkpoints == ["checkpoint_2", "checkpoint_3"], objects

    # The S3 keys are in no object, parameter, log line or worker log.
    secret = KEYS["AWS_SECRET_ACCESS_KEY"]
    for key in objects:
        assert secret.encode() not in s3.get_object(Bucket="team", Key=key)["Body"].read(), key
    assert secret not in json.dumps([r.parameters for r in runs], default=str)
    assert not [line.message for line in logs if secret in line.message]
    for log in Path(folder).glob("worker-*.log"):
        assert secret not in log.read_text(errors="replace"), log
