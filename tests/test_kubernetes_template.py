"""The Kubernetes work pool templates render, through prefect-kubernetes' own worker code,
into the Job a train-node run would get: GPUs requested, and the shared home mounted (or,
for the object store, a disk of the pod's own and the bucket's settings)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from uuid import uuid4

from training.config import TrainingSpec

TEMPLATES = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
TEMPLATE = TEMPLATES / "base-job-template.json"


def _render(values: dict, template_file: Path = TEMPLATE) -> dict:
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = json.loads(template_file.read_text())
    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(
        template, values))
    config.prepare_for_flow_run(FlowRun(flow_id=uuid4(), name="train-node-run"))
    return config.job_manifest


def test_a_node_job_requests_gpus_and_mounts_the_shared_home(prefect_engine):
    manifest = _render({"image": "registry.example/trainflow:1", "gpus": 8,
                        "home_claim": "team-home"})
    pod = manifest["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "registry.example/trainflow:1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/trainflow"]]["persistentVolumeClaim"]["claimName"] == "team-home"
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TRAINFLOW_HOME"] == "/trainflow" and "PREFECT__FLOW_RUN_ID" in env


def test_defaults_render_a_one_gpu_job(prefect_engine):
    [container] = _render({})["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"] == "trainflow-worker:latest"  # deploy/docker/Dockerfile's
    # An eviction leaves the ranks their preemption_grace_s (25 s) to save, with room to spare.
    grace = _render({})["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > TrainingSpec().preemption_grace_s + 10


def test_the_object_store_job_mounts_no_claim_and_takes_the_bucket_from_the_cluster(
        prefect_engine):
    manifest = _render({"gpus": 8, "local_disk": "500Gi", "remote_settings": "team-remote",
                        "s3_secret": "team-s3"}, TEMPLATES / "object-store-job-template.json")
    pod = manifest["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert "persistentVolumeClaim" not in json.dumps(manifest)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/trainflow"]]["emptyDir"] == {"sizeLimit": "500Gi"}
    assert container["envFrom"] == [{"configMapRef": {"name": "team-remote"}},
                                    {"secretRef": {"name": "team-s3"}}]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TRAINFLOW_HOME"] == "/trainflow"
