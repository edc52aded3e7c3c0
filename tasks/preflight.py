"""check_before_start: everything that would make the flow fail late, checked in seconds."""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prefect import task
from prefect.client.schemas.objects import WorkQueueStatus
from prefect.exceptions import ObjectNotFound

from runtime.credentials import MissingSecretBlock, use_secret_blocks
from runtime.launcher import LaunchFailed
from runtime.mlflow_logging import fail_fast_http
from tasks import run_logger
from trainflow_serving.model_names import network_library
from training.config import DatasetSpec, TrainingSpec
from training.data.kaggle import MISSING_CREDENTIALS, find_credentials
from training.data.sources import check_source
from training.hardware import gpu_driver_present
from training.storage import home, redacted, tracking_uri

if TYPE_CHECKING:  # the flows load without torch
    from training.models.arrival import Resolved


class PreflightError(RuntimeError):
    pass


def check_mlflow() -> None:
    """The tracking store answers, takes these credentials and accepts writes (an experiment
    lookup/creation), and the experiment's artifact store can be listed.

    An unreachable server fails this in seconds, not after MLflow's default minutes of retries;
    a refused password or a missing bucket fails it before any download or launch, not at
    registration after the training.
    """
    fail_fast_http()
    try:
        use_secret_blocks()
    except MissingSecretBlock as e:
        raise PreflightError(str(e)) from None
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from tasks.tracking import experiment_id

    uri = tracking_uri()
    # A deployment run may start while the server restarts: the services' workers wait up to
    # TRAINFLOW_MLFLOW_WAIT_S for it (60 s); a hand-started run (0 s) is told at once.
    deadline = time.monotonic() + float(os.environ.get("TRAINFLOW_MLFLOW_WAIT_S", "0"))
    while True:
        try:
            connect_once(uri)
            client = MlflowClient(uri)  # a database store connects here already
            experiment = client.get_experiment(experiment_id(client))
            break
        except MlflowException as e:
            if e.get_http_status_code() in (401, 403):
                user = os.environ.get("MLFLOW_TRACKING_USERNAME")
                raise PreflightError(
                    f"MLflow at {redacted(uri)} refused the credentials "
                    f"({'user ' + repr(user) if user else 'none given'}; HTTP "
                    f"{e.get_http_status_code()}): set MLFLOW_TRACKING_USERNAME and "
                    "MLFLOW_TRACKING_PASSWORD, or name a Prefect Secret block holding them in "
                    "TRAINFLOW_MLFLOW_SECRET_BLOCK") from None
            problem = _unreachable(uri, e)
        except Exception as e:
            problem = _unreachable(uri, e)
        if time.monotonic() > deadline or "refused its user and password" in problem:
            raise PreflightError(problem)
        run_logger().warning("%s; trying again for up to %.0f s more", problem,
                             deadline - time.monotonic())
        time.sleep(3)
    check_artifact_store(uri, experiment.artifact_location)


def connect_once(uri: str) -> None:
    """One connection to a database tracking store, so a refused password or a stopped
    database is named now: MlflowClient retries ten times over about 100 s before it says."""
    if "://" not in uri or uri.split("://", 1)[0].split("+")[0] not in (
            "postgresql", "mysql", "mssql"):
        return
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect():
            pass
    finally:
        engine.dispose()


def _unreachable(uri: str, e: Exception) -> str:
    if "password authentication failed" in str(e):
        return (f"the database of MLflow tracking store {redacted(uri)} refused its user and "
                "password: correct them in MLFLOW_TRACKING_URI")
    return (f"MLflow tracking store {redacted(uri)} is not reachable or not writable "
            f"({type(e).__name__}: {str(e)[:200]}); start it (make services) or set "
            "MLFLOW_TRACKING_URI to a running server")


def check_artifact_store(uri: str, location: str) -> None:
    """List the experiment's artifact root: through an MLflow server, that reaches its bucket."""
    import mlflow

    from tasks.tracking import fluent_mlflow

    try:
        with fluent_mlflow(uri):  # an mlflow-artifacts: root is the tracking server's
            mlflow.artifacts.list_artifacts(artifact_uri=location)
    except Exception as e:
        raise PreflightError(
            f"the artifact store {location} cannot be listed ({type(e).__name__}: "
            f"{str(e)[:300]}): check that the bucket exists and its endpoint answers, and the "
            "S3 keys (the MLflow server's own, for mlflow-artifacts:; AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or TRAINFLOW_S3_SECRET_BLOCK, for an s3:// root)") from None


def check_dataset(dataset: DatasetSpec) -> None:
    check_source(dataset)
    if dataset.kind == "kaggle":
        from training.data.kaggle import complete_copies
        from training.data.sources import source_root

        cached = bool(complete_copies(source_root(dataset, home())))
        if not cached and not os.environ.get("KAGGLE_SECRET_BLOCK") and find_credentials() is None:
            raise PreflightError(MISSING_CREDENTIALS)


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (x86 AVX512-BF16/AMX, Arm BF16)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return True  # cannot tell: do not refuse
    flags = set(text.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16: bool


def local_gpus() -> list[Gpu]:
    """The GPUs the ranks on this machine would use, as CUDA sees them."""
    if not gpu_driver_present():
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    # Native bf16 is compute capability 8.0 (Ampere) or newer; older GPUs emulate it slowly.
    return [Gpu(name, torch.cuda.get_device_capability(i) >= (8, 0))
            for i, name in enumerate(names)]


def check_training(training: TrainingSpec, gpus: list[Gpu] | None = None) -> Resolved:
    """The network as it arrives (the spec it makes: a user network that loads its own weights
    is a fine-tune, at a size its forward pass takes), then that spec against this machine
    (`gpus`: what CUDA reports), the other machines and the starting weights."""
    if importlib.util.find_spec("accelerate") is None:
        raise PreflightError("accelerate is not installed in this environment: run make install")
    resolved = network_as_it_arrives(training)
    training = resolved.training
    check_hardware(training, local_gpus() if gpus is None else gpus)
    if training.num_machines > 1:
        check_machines(training)
    if resolved.network is not None and (training.head or ":" in training.model):
        check_head(resolved.network, training.head)
    check_starting_weights(training)
    return resolved


def check_hardware(training: TrainingSpec, gpus: list[Gpu]) -> None:
    """Process counts, precision and BatchNorm against this machine's GPUs and CPU."""
    wanted = training.resolved_num_processes(len(gpus))
    if gpus and wanted > len(gpus) and not training.accelerate_config_file:
        raise PreflightError(f"training.num_processes={wanted} but this machine has {len(gpus)} "
                             f'GPUs; use at most {len(gpus)} or "auto"')
    if not gpus and wanted > (os.cpu_count() or 1):
        raise PreflightError(f"training.num_processes={wanted} but this machine has "
                             f"{os.cpu_count()} CPU cores and no GPU; use at most "
                             f'{os.cpu_count()} or "auto"')
    old_gpus = sorted({gpu.name for gpu in gpus[:wanted] if not gpu.bf16})
    if training.mixed_precision == "bf16" and old_gpus:
        raise PreflightError(
            f'mixed_precision="bf16" needs a GPU with native bf16 (Ampere or newer), and '
            f"{', '.join(old_gpus)} has none: it would be emulated, many times slower; use "
            '"fp16" on this GPU, or bf16 on a newer one')
    if not gpus and training.mixed_precision == "fp16":
        raise PreflightError('mixed_precision="fp16" needs a CUDA GPU; on this machine use '
                             '"bf16" or "no"' if cpu_has_bf16() else
                             'mixed_precision="fp16" needs a CUDA GPU; on this machine use "no"')
    if not gpus and training.mixed_precision == "bf16" and not cpu_has_bf16():
        # Measured here (AVX2 only): a resnet18 step at 64 px took 28x as long as in fp32.
        raise PreflightError(
            'mixed_precision="bf16" on this machine would be emulated: it has no GPU and its '
            "CPU has no bf16 instructions (avx512_bf16, amx_bf16), which makes training many "
            'times slower than fp32; use mixed_precision="no" here, bf16 on a GPU')
    if training.batchnorm == "sync" and not gpus:
        raise PreflightError('training.batchnorm="sync" needs CUDA GPUs (torch\'s '
                             'SyncBatchNorm); on this machine use "frozen", "train" or "auto"')


def check_starting_weights(training: TrainingSpec) -> None:
    """The weights file, or the library's published weights, are on this machine: nothing is
    downloaded mid-launch."""
    if training.weights and not Path(training.weights).is_file():
        raise PreflightError(f"training.weights {training.weights} does not exist on this "
                             "machine; give the path of a safetensors or state-dict file")
    if not training.pretrained:
        return
    from training.models.build import TIMM, pretrained_weights_file, timm_pretrained

    if training.model.startswith(TIMM):
        try:
            timm_pretrained(training.model, num_classes=2)
        except FileNotFoundError as e:
            raise PreflightError(str(e)) from None
    elif (network_library(training.model) == "torchvision"
          and not (path := pretrained_weights_file(training.model)).is_file()):
        raise PreflightError(f"pretrained weights for {training.model} are not in the torch "
                             f"cache: expected {path}; copy them there or set "
                             "training.pretrained=false")


def network_as_it_arrives(training: TrainingSpec) -> Resolved:
    """training.models.arrival.as_it_arrives, its refusals (a network that cannot be built, a
    size it cannot take) as preflight errors."""
    from training.models.arrival import as_it_arrives

    try:
        return as_it_arrives(training)
    except ValueError as e:
        raise PreflightError(str(e)) from None


def check_head(network, head: str | None) -> None:
    """The head a new one replaces is there and is a Linear layer, before any download."""
    from training.models.build import replaceable_head

    try:
        replaceable_head(network, head)
    except ValueError as e:
        raise PreflightError(str(e)) from None


class NodesUnavailable(LaunchFailed):
    """Not enough machines are ready to take the nodes."""


def check_workers(client, spec: TrainingSpec, first: int = 0) -> None:
    """Every node from machine `first` on has a worker ready to take it, or a clear error now
    rather than a stuck run. (With a remote root, machine 0 is the flow's own launch.)"""
    try:
        deployment = client.read_deployment_by_name(spec.node_deployment)
    except ObjectNotFound:
        raise NodesUnavailable(
            f"training.num_machines={spec.num_machines} runs each machine's launch as the "
            f"deployment {spec.node_deployment!r}, which does not exist: run `prefect deploy "
            "--name nodes` from the repository root (prefect.yaml)") from None
    pool = deployment.work_pool_name
    # One queue for all nodes (Kubernetes): one worker starts every pod and the cluster's
    # scheduler places them, so a polled queue is all that can be checked here.
    queues = sorted({spec.node_queue(rank) for rank in range(first, spec.num_machines)})
    idle = []
    for queue in queues:
        try:
            ready = client.read_work_queue_by_name(queue, work_pool_name=pool).status
        except ObjectNotFound:
            ready = None
        if ready != WorkQueueStatus.READY:
            idle.append(queue)
    if idle:
        raise NodesUnavailable(
            f"training.num_machines={spec.num_machines} needs a worker on each of the work "
            f"queues {queues} of pool {pool!r}, and none polls {idle}. On each machine i start "
            f"`prefect worker start --pool {pool} --work-queue {spec.node_queue(0)}` "
            "(with its own rank), or lower training.num_machines")


def check_remote():
    """The remote root, when one is set, answers with these credentials (a Secret block's are
    loaded here, before the first result is looked up in the bucket)."""
    from runtime.remote import RemoteRootError, check_remote_root, remote_root

    try:
        remote = remote_root()
        if remote is not None:
            check_remote_root(remote)
    except RemoteRootError as e:
        raise PreflightError(str(e)) from None
    return remote


def check_machines(training: TrainingSpec) -> None:
    """A worker ready for every machine's node, before the dataset is even downloaded."""
    from prefect import get_client

    from runtime.remote import REMOTE_ROOT

    # The bucket itself is checked once, by check_remote; with one, machine 0 is the flow's.
    machine_0_here = bool(os.environ.get(REMOTE_ROOT, "").strip())
    with get_client(sync_client=True) as client:
        try:
            check_workers(client, training, first=1 if machine_0_here else 0)
        except NodesUnavailable as e:
            raise PreflightError(str(e)) from None


@task
def check_before_start(dataset: DatasetSpec, training: TrainingSpec) -> TrainingSpec:
    """Fail in seconds, with one clear message, on what would otherwise fail late; the training
    spec as its network arrives (a user network that loads its own weights is a fine-tune)."""
    check_mlflow()
    check_remote()
    check_dataset(dataset)
    resolved = check_training(training)
    logger = run_logger()
    for note in resolved.notes:
        logger.info("%s", note)
    logger.info("preflight passed: MLflow at %s, dataset %s, %s processes",
                redacted(tracking_uri()), dataset.source,
                resolved.training.resolved_num_processes())
    return resolved.training
