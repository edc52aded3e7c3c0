"""Real `accelerate launch` runs: DDP correctness, resume, failures, hangs, ports, machines."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time

import pytest
from safetensors.torch import load_file

from runtime.launcher import (
    LaunchFailed,
    LaunchHung,
    LaunchPreempted,
    launch_command,
    launch_env,
)
from tasks.train import run_training
from training.engine.checkpoint import STATE_FILE
from training.engine.progress import ProgressReader
from training.handoff import TrainJob
from training.models.build import build_model
from training.processes import alive, free_port

pytestmark = pytest.mark.slow
LOG = logging.getLogger("test-training")


def _job(digits_split, tmp_path, name="run", **training):
    _, split = digits_split
    spec = {"epochs": 2, "batch_size": 50, "image_size": 12, "num_processes": 2, **training}
    return TrainJob(split=split, output_dir=tmp_path / name, training=spec)


def _threads(processes: int) -> int:
    """Torch threads each rank should get: an explicit OMP_NUM_THREADS, else the cores shared."""
    return int(os.environ.get("OMP_NUM_THREADS", 0)) or max(
        1, len(os.sched_getaffinity(0)) // processes)


def _rank_pids(output_dir) -> list[int]:
    reader = ProgressReader(output_dir)
    return [e.pid for e in reader.poll() if e.event == "start"]


def test_two_process_ddp_counts_each_val_image_once(digits_split, tmp_path):
    _, split = digits_split
    val_size = sum(split.counts["val"].values())
    assert val_size % 50 != 0  # the batch size does not divide the split
    job = _job(digits_split, tmp_path)
    result = run_training(job, LOG)
    starts = [e for e in ProgressReader(job.output_dir).poll() if e.event == "start"]
    assert sorted(e.rank for e in starts) == [0, 1]
    assert {e.world_size for e in starts} == {2}  # what ran, not what was asked
    assert {e.threads for e in starts} == {_threads(2)}  # the cores shared out
    assert result.world_size == 2
    [params] = [e.params for e in ProgressReader(job.output_dir).poll()
                if e.event == "params"]
    assert params["loader_workers"] == 0  # "auto" on a machine without GPUs
    assert all(h.val_images == val_size for h in result.history)
    assert len(result.history) == 2
    assert result.best_metrics.val_accuracy > 0.5  # chance is 0.1
    weights = load_file(result.weights)
    fresh = build_model("basicnet", 10, 1, 12)
    assert set(weights) == set(fresh.state_dict())
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in weights)
    fresh.load_state_dict(weights, strict=True)
    assert (job.output_dir / "checkpoints" / "checkpoint_2" / STATE_FILE).is_file()

    single = run_training(_job(digits_split, tmp_path, "single", num_processes=1), LOG)
    assert single.world_size == 1
    # accelerate launch alone would give a single CPU process one thread and idle the rest.
    assert [e.threads for e in ProgressReader(tmp_path / "single").poll()
            if e.event == "start"] == [_threads(1)]
    assert [h.val_images for h in single.history] == [val_size, val_size]


@pytest.mark.extended
def test_a_decode_longer_than_the_collective_timeout_does_not_fail_the_run(digits_split,
                                                                          tmp_path):
    """The ranks decode before their first collective: one decodes under the store's lock while
    the other waits on the lock, so a decode longer than a collective may wait is harmless."""
    job = _job(digits_split, tmp_path, epochs=1, image_size=13)  # a side no other test decodes
    result = run_training(job, LOG, extra_env={"TRAINFLOW_FAULT": "slow_decode:seconds=16",
                                               "TRAINFLOW_COLLECTIVE_TIMEOUT_S": "8"})
    assert result.world_size == 2 and len(result.history) == 1
    events = ProgressReader(job.output_dir).poll()
    decoders: dict[str, set[int]] = {}
    for e in events:
        if str(getattr(e, "phase", "")).startswith("decode"):
            decoders.setdefault(e.phase, set()).add(e.rank)
    assert set(decoders) == {"decode train", "decode val"}
    assert all(len(ranks) == 1 for ranks in decoders.values()), decoders  # each split once


def test_each_rank_draws_its_own_augmentation_while_the_shards_stay_disjoint(digits_split,
                                                                            tmp_path):
    """After the training's own setup, under a real 2-process launch: the samplers agree (each
    training image in exactly one rank's shard) and the random draws differ by rank, the same
    on every run."""
    job = _job(digits_split, tmp_path, augment="crop_flip")
    spec, job_file = job.training, job.save()
    seen = []
    for attempt in ("first", "again"):
        out = tmp_path / attempt
        out.mkdir()
        env = launch_env()
        subprocess.run(launch_command(spec, "tests.probes.rank_seeds", [str(job_file), str(out)],
                                      env=env), env=env, check=True, timeout=300,
                       capture_output=True)
        seen.append([json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)])
    first, again = seen
    shards = [set(rank["indices"]) for rank in first]
    train_size = sum(digits_split[1].counts["train"].values())
    padding = sum(len(rank["indices"]) for rank in first) - train_size  # to even batches
    assert len(shards[0] & shards[1]) <= padding < 2 * spec.batch_size
    assert len(shards[0] | shards[1]) == train_size
    assert first[0]["draws"] != first[1]["draws"]
    assert first == again


def test_killed_rank_ends_the_launch_and_retry_resumes(digits_split, tmp_path):
    job = _job(digits_split, tmp_path, epochs=3, heartbeat_steps=1)
    errors: list[BaseException] = []

    def attempt():
        try:
            run_training(job, LOG, extra_env={"TRAINFLOW_FAULT": "slow:step=0.25"})
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=attempt)
    thread.start()
    reader, killed_at, pids = ProgressReader(job.output_dir), None, []
    deadline = time.monotonic() + 120
    while killed_at is None and time.monotonic() < deadline:
        events = reader.poll() if reader.folder.exists() else []
        pids += [e.pid for e in events if e.event == "start"]
        # Mid-epoch 2: rank 1's heartbeat of a step of epoch 2, not a guess of how long it takes.
        if any(e.event == "heartbeat" and e.phase == "train" and e.epoch == 2 and e.rank == 1
               for e in events):
            victim = next(e for e in ProgressReader(job.output_dir).poll()
                          if e.event == "start" and e.rank == 1)
            os.kill(victim.pid, signal.SIGKILL)
            killed_at = time.monotonic()
        time.sleep(0.1)
    thread.join(120)
    assert killed_at is not None, "training never reached epoch 2"
    assert not thread.is_alive(), "the launch outlived its killed rank"
    assert errors and isinstance(errors[0], LaunchFailed)
    assert [p for p in pids if alive(p)] == []

    resumed = run_training(job, LOG, resume=True)
    assert [h.epoch for h in resumed.history] == [1, 2, 3]
    events = ProgressReader(job.output_dir).poll()
    assert any(e.event == "resumed" and e.epoch == 1 for e in events)
    epochs_run = [e.epoch for e in events if e.event == "epoch" and e.rank == 0]
    assert epochs_run == [1, 2, 3]  # epoch 1 was not repeated


@pytest.mark.timeout(240)  # a hang guard: failing fast is what the error's reason shows
def test_a_failing_rank_fails_fast_with_its_own_error_shown_once(digits_split, tmp_path,
                                                                  caplog):
    job = _job(digits_split, tmp_path)
    with caplog.at_level(logging.INFO, logger=LOG.name), pytest.raises(LaunchFailed) as error:
        run_training(job, LOG, extra_env={"TRAINFLOW_FAULT": "raise:rank=1:epoch=1:step=2"})
    message = str(error.value)
    assert message.startswith("rank 1 failed") and "\n" not in message
    assert "RuntimeError: injected fault on rank 1 at epoch 1 step 2" in message
    assert "in on_step" in error.value.traceback
    # The rank's traceback (not rank 0's broken pipe, not torchrun's) is in the log once, in the
    # line that names the rank.
    shown = [r for r in caplog.records if "Traceback (most recent call last)" in r.getMessage()]
    assert len(shown) == 1, [r.getMessage()[:200] for r in shown]
    assert shown[0].levelno == logging.ERROR and shown[0].getMessage().startswith("rank 1 failed")
    assert "in on_step" in shown[0].getMessage()
    assert not any("ChildFailedError" in r.getMessage() for r in caplog.records)
    assert [p for p in _rank_pids(job.output_dir) if alive(p)] == []


@pytest.mark.timeout(240)  # a hang guard: the watchdog's own message names its 6 s
def test_a_hung_rank_is_detected_by_the_watchdog(digits_split, tmp_path):
    job = _job(digits_split, tmp_path, hang_timeout_s=6, heartbeat_steps=1)
    with pytest.raises(LaunchHung) as error:
        run_training(job, LOG, extra_env={"TRAINFLOW_FAULT": "hang:rank=1:epoch=1:step=3"})
    assert "no rank made progress for 6 s" in str(error.value)
    assert "rank 1 last heartbeat" in str(error.value)
    assert [p for p in _rank_pids(job.output_dir) if alive(p)] == []


def test_two_trainings_at_once_do_not_clash(digits_split, tmp_path):
    results, errors = [], []

    def one(name):
        try:
            results.append(run_training(_job(digits_split, tmp_path, name, epochs=1), LOG))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == [] and [r.world_size for r in results] == [2, 2]


def test_two_machines_on_loopback_train_one_job(digits_split, tmp_path):
    """Two bare `accelerate launch` invocations, machine ranks 0 and 1, one process each,
    join by c10d rendezvous and train one job in one (shared) run folder."""
    port = free_port()
    events, errors = {}, []

    def machine(rank):
        job = _job(digits_split, tmp_path, "shared", epochs=1, num_processes=1,
                   num_machines=2, machine_rank=rank, main_process_ip="127.0.0.1",
                   main_process_port=port)
        try:
            events[rank] = _bare_launch(job)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=machine, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == []
    seen = ProgressReader(tmp_path / "shared").poll()
    assert sorted((e.rank, e.world_size) for e in seen if e.event == "start") == [
        (0, 2), (1, 2)]
    assert [e.world_size for e in seen if e.event == "trained" and e.rank == 0] == [2]


def _bare_launch(job, *options, env=None):
    """A launch with no task around it (machine rank 1 alone, or training without Prefect)."""
    from runtime.launcher import LaunchWatch, launch_command, launch_env, run_launch

    command = launch_command(job.training, "training.train",
                             ["--job", str(job.save()), *options])
    return run_launch(command, launch_env(env), job.output_dir, LaunchWatch(hang_timeout_s=120))


def test_training_alone_logs_to_the_run_it_is_given(digits_split, tmp_path):
    """Without Prefect: `training.train --log-with mlflow` logs from the main process."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("alone", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(experiment).info.run_id
    job = _job(digits_split, tmp_path, epochs=2)
    # the bare launch, no task watching it
    _bare_launch(job, "--log-with", "mlflow",
                 env={"MLFLOW_RUN_ID": run_id, "MLFLOW_TRACKING_URI": uri})
    run = client.get_run(run_id)
    assert run.data.params["world_size"] == "2"
    assert [m.step for m in client.get_metric_history(run_id, "val_accuracy")] == [1, 2]


def test_a_preemption_notice_mid_epoch_saves_there_and_the_retry_resumes_at_the_next_batch(
        digits_split, tmp_path):
    """SIGTERM to the launch (torchrun passes it to every rank), as a spot notice or an eviction
    sends it: the ranks agree on a step, save there and stop; the retry does the rest of that
    epoch and ends exactly where an uninterrupted run does."""
    whole = run_training(_job(digits_split, tmp_path, "whole", heartbeat_steps=2), LOG,
                         resume=False)
    job = _job(digits_split, tmp_path, "cut", heartbeat_steps=2)
    with pytest.raises(LaunchPreempted, match="preempted in epoch 2 after batch"):
        run_training(job, LOG, resume=False,
                     extra_env={"TRAINFLOW_FAULT": "preempt:rank=0:epoch=2:step=4"})
    events = ProgressReader(job.output_dir).poll()
    stops = [e for e in events if e.event == "preempted"]
    assert sorted(e.rank for e in stops) == [0, 1]  # every rank stopped after the same batch
    assert len({(e.epoch, e.batches) for e in stops}) == 1 and 4 <= stops[0].batches < 15
    assert not any(e.event == "error" for e in events)

    resumed = run_training(job, LOG, resume=True)
    events = ProgressReader(job.output_dir).poll()
    assert [(e.epoch, e.batches) for e in events if e.event == "resumed" and e.rank == 0] == [
        (1, stops[0].batches)]
    # Epoch 2's first heartbeat after the resume is past the batches already trained.
    after = [e.step for e in events if e.event == "heartbeat" and e.phase == "train"
             and e.epoch == 2 and e.time > stops[0].time]
    assert after and min(after) > stops[0].batches
    for done, uninterrupted in zip(resumed.history, whole.history, strict=True):
        assert done.optimizer_steps == uninterrupted.optimizer_steps
        assert done.learning_rate == pytest.approx(uninterrupted.learning_rate, rel=1e-9)
        for name in ("train_loss", "train_accuracy", "val_loss", "val_accuracy"):
            assert getattr(done, name) == pytest.approx(getattr(uninterrupted, name),
                                                        rel=1e-4, abs=1e-6), name


@pytest.mark.parametrize(("device", "processes", "synced"), [
    ("cuda", 2, True), ("cuda", 1, False), ("cpu", 2, False)])
def test_batchnorm_is_synced_across_gpu_ranks_and_its_weights_load_into_plain_batchnorm(
        digits_split, tmp_path, device, processes, synced):
    import torch

    from training.train import batchnorm_mode, make_model

    _, split = digits_split
    job = TrainJob(split=split, output_dir=tmp_path, training={"model": "resnet18",
                                                                "image_size": 32})
    model = make_model(job, batchnorm_mode(job.training, device, processes))
    norms = [m for m in model.modules()
             if isinstance(m, torch.nn.BatchNorm2d | torch.nn.SyncBatchNorm)]
    assert len(norms) == 20
    assert all(isinstance(m, torch.nn.SyncBatchNorm) for m in norms) == synced
    assert any(isinstance(m, torch.nn.SyncBatchNorm) for m in norms) == synced
    # What is saved from a synced model loads, strictly, into the plain network that serves.
    plain = build_model("resnet18", len(split.class_names), 3, 32)
    plain.load_state_dict(model.state_dict(), strict=True)
    off = job.training.model_copy(update={"batchnorm": "train"})
    assert not any(isinstance(m, torch.nn.SyncBatchNorm)
                   for m in make_model(job, batchnorm_mode(off, device, processes)).modules())
