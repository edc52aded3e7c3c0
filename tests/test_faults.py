"""Faults a months-long unattended retraining service must survive, with real processes."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest
from mlflow import MlflowClient
from safetensors.torch import load_file

from tasks.lineage import FLOW_RUN_ID
from tasks.preflight import Gpu, PreflightError, check_training
from tasks.train import run_training
from tests.servers import mlflow_server
from training.config import TrainingSpec
from training.engine.progress import ProgressReader
from training.handoff import TrainJob
from training.processes import free_port
from training.storage import atomic_path, tracking_uri

LOG = logging.getLogger("test-faults")


@pytest.mark.slow
def test_killed_rank_in_a_flow_is_retried_resumed_and_registered_once(
        prefect_engine, tmp_path, monkeypatch):
    from flows.train_flow import train_flow

    monkeypatch.setenv("TRAINFLOW_FAULT", "kill:rank=1:epoch=2:step=2")
    monkeypatch.setenv("TRAINFLOW_FAULT_ONCE", str(tmp_path / "fired"))
    result = train_flow(dataset={"source": "builtin:digits"},
                        training={"epochs": 3, "image_size": 12, "batch_size": 50},
                        registry={"model_name": "fault-digits"})
    assert (tmp_path / "fired").exists()  # the rank really was killed once
    events = ProgressReader(result.trained.output_dir).poll()
    assert any(e.event == "resumed" and e.epoch == 1 for e in events)
    assert [h.epoch for h in result.trained.history] == [1, 2, 3]
    client = MlflowClient(tracking_uri())
    flow_run_id = client.get_run(result.mlflow_run_id).data.tags[FLOW_RUN_ID]
    versions = client.search_model_versions("name='fault-digits'")
    assert [v.tags[FLOW_RUN_ID] for v in versions] == [flow_run_id]
    runs = client.search_runs([client.get_run(result.mlflow_run_id).info.experiment_id],
                              filter_string=f"tags.`{FLOW_RUN_ID}` = '{flow_run_id}'")
    assert [r.info.status for r in runs] == ["FINISHED"]


@pytest.mark.slow
def logging_training(digits_split, url: str, tmp_path, epochs: int) -> tuple[str, TrainJob]:
    """An MLflow run on the server at `url`, and a 2-process digits job to log into it."""
    client = MlflowClient(url)
    run_id = client.create_run(client.create_experiment(tmp_path.name)).info.run_id
    job = TrainJob(split=digits_split[1], output_dir=tmp_path / "train",
                   training={"epochs": epochs, "image_size": 12, "batch_size": 50,
                             "num_processes": 2, "heartbeat_steps": 1})
    return run_id, job


def when_an_epoch_ends(job: TrainJob, action) -> threading.Thread:
    """A thread that runs `action` once rank 0 has reported its first finished epoch."""

    def watch():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (job.output_dir / "progress").exists() and any(
                    e.event == "epoch" for e in ProgressReader(job.output_dir).poll()):
                action()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    return watcher


def test_mlflow_going_down_mid_training_keeps_the_weights(digits_split, tmp_path, monkeypatch):
    server = mlflow_server(tmp_path / "mlflow")
    url = server.__enter__()
    run_id, job = logging_training(digits_split, url, tmp_path, epochs=3)
    # The two epochs after the stop outlast the server's shutdown even on a loaded machine,
    # so their metrics really meet a server that is gone.
    monkeypatch.setenv("TRAINFLOW_FAULT", "slow:step=0.3")
    monkeypatch.setenv("TRAINFLOW_MLFLOW_PATIENCE_S", "2")  # it does not come back
    stopped = threading.Event()

    def stop_server():
        server.__exit__(None, None, None)
        stopped.set()

    watcher = when_an_epoch_ends(job, stop_server)
    try:
        result = run_training(job, LOG, mlflow_run_id=run_id, tracking_uri=url)
    finally:
        watcher.join(130)
        if not stopped.is_set():
            server.__exit__(None, None, None)
    assert stopped.is_set()
    assert [h.epoch for h in result.history] == [1, 2, 3]
    assert result.mlflow_unsent > 0  # the task reports what could not be logged
    assert load_file(result.weights)  # the trained weights are on disk and readable


@pytest.mark.extended
def test_mlflow_restarted_during_training_gets_every_epoch(digits_split, tmp_path, monkeypatch):
    """The server is killed during epoch 2 and started again 20 s later on the same store: the
    training goes on, and the epochs logged while it was down arrive once it is back."""
    port = free_port()
    first = mlflow_server(tmp_path / "mlflow", port)
    url = first.__enter__()
    run_id, job = logging_training(digits_split, url, tmp_path, epochs=4)
    monkeypatch.setenv("TRAINFLOW_FAULT", "slow:step=0.2")
    down_at, back = [], threading.Event()
    second = mlflow_server(tmp_path / "mlflow", port)

    def restart():
        first.__exit__(None, None, None)
        down_at.append(time.monotonic())
        time.sleep(20)
        second.__enter__()
        back.set()

    watcher = when_an_epoch_ends(job, restart)
    try:
        result = run_training(job, LOG, mlflow_run_id=run_id, tracking_uri=url)
    finally:
        watcher.join(180)
        if back.is_set():
            second.__exit__(None, None, None)
        elif not down_at:
            first.__exit__(None, None, None)
    assert down_at and back.is_set()
    assert [h.epoch for h in result.history] == [1, 2, 3, 4]
    assert result.mlflow_unsent == 0
    with mlflow_server(tmp_path / "mlflow") as again:
        history = MlflowClient(again).get_metric_history(run_id, "train_loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]


def test_bf16_on_a_cpu_without_bf16_instructions_is_refused_before_work(monkeypatch):
    import torch

    from tasks import preflight

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setattr(preflight, "cpu_has_bf16", lambda: False)  # as on this AVX2 machine
    with pytest.raises(PreflightError, match='"bf16" on this machine would be emulated'):
        check_training(TrainingSpec(mixed_precision="bf16"))
    with pytest.raises(PreflightError, match='use "no"'):
        check_training(TrainingSpec(mixed_precision="fp16"))
    monkeypatch.setattr(preflight, "cpu_has_bf16", lambda: True)
    check_training(TrainingSpec(mixed_precision="bf16"))


def test_fp16_on_a_cpu_machine_is_refused_before_work():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(PreflightError, match='"fp16" needs a CUDA GPU; .* use '):
        check_training(TrainingSpec(mixed_precision="fp16"))
    with pytest.raises(PreflightError, match="CPU cores and no GPU"):
        check_training(TrainingSpec(num_processes=64))


def test_gpu_precision_and_counts_are_checked_against_the_gpus_named():
    """What CUDA would report on a GPU machine, given as the check's input (no GPU here)."""
    t4, h200 = Gpu("Tesla T4", bf16=False), Gpu("NVIDIA H200", bf16=True)
    with pytest.raises(PreflightError, match=r"Tesla T4 has none: .* use \"fp16\" on this GPU"):
        check_training(TrainingSpec(mixed_precision="bf16"), gpus=[t4, t4])
    check_training(TrainingSpec(mixed_precision="fp16"), gpus=[t4, t4])
    check_training(TrainingSpec(mixed_precision="bf16"), gpus=[h200, h200])
    # "auto" takes every GPU; the T4 is only checked when a rank would run on it.
    check_training(TrainingSpec(mixed_precision="bf16", num_processes=1), gpus=[h200, t4])
    with pytest.raises(PreflightError, match="Tesla T4 has none"):
        check_training(TrainingSpec(mixed_precision="bf16"), gpus=[h200, t4])
    with pytest.raises(PreflightError, match="num_processes=3 but this machine has 2 GPUs"):
        check_training(TrainingSpec(num_processes=3), gpus=[h200, h200])


def test_pretrained_weights_missing_from_cache_name_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(PreflightError, match=r"expected .*/torch/hub/checkpoints/resnet18-.*\.pth"):
        check_training(TrainingSpec(model="resnet18", pretrained=True))


def test_a_failed_write_leaves_the_old_file_whole(tmp_path):
    final = tmp_path / "manifest.csv"
    final.write_text("old complete contents\n")
    with pytest.raises(RuntimeError), atomic_path(final) as tmp:
        tmp.write_text("half of the new")
        raise RuntimeError("disk full")
    assert final.read_text() == "old complete contents\n"
    assert list(tmp_path.iterdir()) == [final]


def test_a_write_killed_mid_way_never_leaves_a_truncated_file(tmp_path):
    final = tmp_path / "best.safetensors"
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from training.storage import atomic_path\n"
        f"with atomic_path(Path({str(final)!r})) as tmp, open(tmp, 'wb') as f:\n"
        "    f.write(b'x' * 1000); f.flush(); print('writing', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.kill()
    proc.wait(10)
    assert not final.exists()




@pytest.mark.slow
def test_a_flow_run_that_failed_in_registration_retries_without_training_again(
        prefect_engine, monkeypatch):
    """Prefect's persisted results: the retried flow run reuses every stage that completed."""
    import flows.registration as registration
    from flows.train_flow import train_flow

    failures = []

    def registry_down_once(*args, **kwargs):
        if not failures:
            failures.append("down")
            raise RuntimeError("the model registry is down (injected)")
        return register_model(*args, **kwargs)

    register_model = registration.register_model
    monkeypatch.setattr(registration, "register_model", registry_down_once)
    result = train_flow.with_options(retries=1, retry_delay_seconds=0)(
        dataset={"source": "builtin:digits"},
        training={"epochs": 2, "image_size": 12, "batch_size": 50},
        registry={"model_name": "resumed-digits"})
    assert failures == ["down"] and result.registration.promoted
    # One training: its ranks started once, and each epoch was logged once.
    events = ProgressReader(result.trained.output_dir).poll()
    assert len([e for e in events if e.event == "start"]) == result.trained.world_size
    client = MlflowClient(tracking_uri())
    assert [m.step for m in client.get_metric_history(result.mlflow_run_id, "train_loss")] == [1, 2]
    flow_run_id = client.get_run(result.mlflow_run_id).data.tags[FLOW_RUN_ID]
    runs = client.search_runs([client.get_run(result.mlflow_run_id).info.experiment_id],
                              filter_string=f"tags.`{FLOW_RUN_ID}` = '{flow_run_id}'")
    assert [r.info.status for r in runs] == ["FINISHED"]
    versions = client.search_model_versions("name='resumed-digits'")
    assert [v.tags[FLOW_RUN_ID] for v in versions] == [flow_run_id]
