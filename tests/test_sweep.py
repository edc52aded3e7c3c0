"""sweep-flow: Optuna trials on the same launcher, pruned on epochs, resumed after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient
from optuna.trial import TrialState

from tasks.lineage import FLOW_RUN_ID
from tasks.sweep import TRIAL_STATE, open_storage, trial_spec
from training.storage import tracking_uri

SMALL = {"epochs": 3, "image_size": 12, "batch_size": 50}
SPACE = {"lr": {"log_uniform": [1e-7, 1e-2]}}
# The base spec's lr, which learns, or one at which nothing is learnt: which trials the pruner
# stops then depends neither on the machine's floating-point results nor on close calls.
# (TPE's seeded start-up draws give trials 1-3 1e-3, 1e-9, 1e-9; trial 0 is the base spec.)
LEARNS_OR_NOT = {"lr": {"choice": [1e-9, 1e-3]}}


def _trials(url: str) -> list[optuna.trial.FrozenTrial]:
    storage = open_storage(url)  # the flow may be creating the same storage right now
    [summary] = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage).trials


RACER = """
import sys, time
from pathlib import Path
from tasks.sweep import open_storage
folder, rounds = Path(sys.argv[1]), int(sys.argv[2])
(folder / f"ready-{sys.argv[3]}").touch()
while not (folder / "t0").exists():
    time.sleep(0.01)
t0 = float((folder / "t0").read_text())
for r in range(rounds):
    while time.time() < t0 + 0.5 * r:
        pass
    open_storage(f"sqlite:///{folder / f'optuna-{r}.db'}")
"""


def test_processes_creating_one_storage_at_the_same_instant_all_open_it(tmp_path):
    """Three processes open each of 10 new SQLite storages at the same instant. Optuna's own
    creation lost this race in 10 of 20 rounds (UNIQUE constraint failed: alembic_version)."""
    rounds, racers = 10, 3
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(rounds), str(i)],
                              stderr=subprocess.PIPE, text=True) for i in range(racers)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < racers and time.monotonic() < deadline:
        time.sleep(0.1)
    (tmp_path / "t0.tmp").write_text(str(time.time() + 0.5))
    (tmp_path / "t0.tmp").rename(tmp_path / "t0")
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * racers, "\n".join(errors)[-3000:]
    for r in range(rounds):
        assert optuna.storages.RDBStorage(f"sqlite:///{tmp_path / f'optuna-{r}.db'}")


@pytest.mark.slow
def test_a_sweep_prunes_nests_its_runs_and_registers_the_best(prefect_engine, tmp_path):
    from flows.sweep_flow import sweep_flow

    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    result = sweep_flow(dataset={"source": "builtin:digits"}, training=SMALL,
                        search_space=LEARNS_OR_NOT, n_trials=4,
                        registry={"model_name": "sweep-digits"}, storage=storage,
                        pruning_warmup_epochs=0)  # 3 epochs: judge from the first
    trials = _trials(storage)
    states = [t.state for t in trials]
    assert len(trials) == 4 and TrialState.PRUNED in states and TrialState.COMPLETE in states
    for trial in trials[2:]:  # after the pruner's 2 start-up trials: stopped at the first epoch
        learns = trial.params["lr"] == 1e-3
        assert trial.state == (TrialState.COMPLETE if learns else TrialState.PRUNED)
        assert trial.user_attrs["epochs_run"] == (3 if learns else 1)
    assert trials[0].params == {"lr": 1e-3}  # the base spec first: never worse than no sweep
    assert result.sweep.trials["PRUNED"] == states.count(TrialState.PRUNED)
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    assert result.sweep.epochs_not_run == sum(3 - t.user_attrs["epochs_run"] for t in pruned) > 0

    client = MlflowClient(tracking_uri())
    parent = client.get_run(result.mlflow_run_id)
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(children) == 4
    assert sorted(c.data.tags[TRIAL_STATE] for c in children) == sorted(
        "pruned" if s == TrialState.PRUNED else "complete" for s in states)
    assert all(len(client.get_metric_history(c.info.run_id, "val_accuracy")) >= 1
               for c in children)
    assert parent.data.params["best.lr"] == str(result.sweep.best_params["lr"])
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "study")} == {
        "study/trials.csv", "study/parallel_coordinates.png"}

    best = max((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    assert result.sweep.best_run_id == best.user_attrs["trainflow.mlflow_run_id"]
    assert result.sweep.best.job.training.lr == best.params["lr"]
    best_run = client.get_run(result.sweep.best_run_id)
    assert "test_accuracy" in best_run.data.metrics  # only the best trial is evaluated
    assert sum("test_accuracy" in c.data.metrics for c in children) == 1
    version = client.get_model_version("sweep-digits", result.registration.version)
    assert version.tags[FLOW_RUN_ID] == parent.data.tags[FLOW_RUN_ID]


@pytest.mark.extended
@pytest.mark.slow
def test_a_killed_sweep_resumes_without_redoing_finished_trials(tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    blocks = {"dataset": {"source": "builtin:digits"}, "training": SMALL,
              "registry": {"model_name": "sweep-resume"}}
    (tmp_path / "sweep.json").write_text(json.dumps(blocks))
    env = {**os.environ, "TRAINFLOW_HOME": str(tmp_path / "home"),
           "PREFECT_HOME": str(tmp_path / "prefect")}
    command = [str(Path(sys.executable).with_name("trainflow")), "sweep", "--config",
               str(tmp_path / "sweep.json"), "--n_trials", "4", "--search_space",
               json.dumps(SPACE), "--storage", storage]
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    finished: list = []
    deadline = time.monotonic() + 400
    while len(finished) < 2 and time.monotonic() < deadline and first.poll() is None:
        time.sleep(1)
        if (tmp_path / "optuna.db").exists():
            try:
                finished = [t for t in _trials(storage)
                            if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
            except (ValueError, KeyError, optuna.exceptions.OptunaError):
                continue
    assert len(finished) >= 2 and first.poll() is None, "the sweep never got two trials done"
    os.killpg(first.pid, signal.SIGKILL)  # the flow process (its server runs on, reused)
    first.wait(30)
    before = {t.number: t.params for t in finished}

    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    finally:  # the local Prefect server both runs used
        subprocess.run([str(Path(sys.executable).parent / "trainflow"), "services", "stop",
                        "--folder", str(tmp_path / "svc")], env=env, capture_output=True,
                       timeout=60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trials = _trials(storage)
    counted = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(counted) == 4  # n_trials in all, across both runs
    assert {n: p for n, p in ((t.number, t.params) for t in counted) if n in before} == before
    assert len(trials) - len(counted) <= 1  # at most the trial the kill interrupted, failed


@pytest.mark.parametrize("params, message", [
    ({"search_space": {}}, "search_space is empty"),
    ({"search_space": {"lr": {"log_uniform": [0, 1]}}}, "log_uniform needs low > 0"),
    ({"search_space": {"lr": {"range": [1, 2]}}}, "Extra inputs are not permitted"),
    ({"search_space": {"learning_rate": {"choice": [0.1]}}}, "not searchable training fields"),
    ({"search_space": {"epochs": {"choice": [1, 2]}}}, "not searchable training fields"),
    ({"search_space": SPACE, "n_trials": 0}, "greater than or equal to 1"),
])
def test_bad_sweeps_are_refused_before_any_trial(prefect_engine, tmp_path, params, message):
    from flows.sweep_flow import sweep_flow

    with pytest.raises(Exception, match=message):
        sweep_flow(dataset={"source": "builtin:digits"}, training=SMALL,
                   storage=f"sqlite:///{tmp_path / 'optuna.db'}", **params)
    assert not (tmp_path / "optuna.db").exists()


def _slots(queue_) -> list:
    return [queue_.get() for _ in range(queue_.qsize())]


def test_a_trial_that_changes_the_model_gets_that_models_default_rate():
    from training.config import TrainingSpec

    base = TrainingSpec(epochs=2, batch_size=8)
    trial = trial_spec(base, {"model": "resnet18"}, {"num_processes": 1})
    assert (trial.model, trial.lr, trial.epochs, trial.batch_size) == ("resnet18", 0.005, 2, 8)
    assert trial_spec(TrainingSpec(lr=0.02), {"model": "resnet18"}, {}).lr == 0.02


def test_trials_are_placed_on_the_visible_gpus_and_share_the_cores(monkeypatch):
    """A stub device count stands in for GPUs this machine lacks."""
    import torch

    from tasks.sweep import device_slots, visible_gpus
    from training.config import TrainingSpec

    monkeypatch.setattr("training.hardware.gpu_driver_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    assert visible_gpus() == ["3", "5", "6"]  # what the user allowed, not 0..2
    base = TrainingSpec(num_processes=2)
    assert _slots(device_slots(base, 2)) == [({"CUDA_VISIBLE_DEVICES": "3,5"},
                                              {"num_processes": 2}),
                                             ({"CUDA_VISIBLE_DEVICES": "6"},
                                              {"num_processes": 1})]  # the leftover used
    # More trials at once than GPUs: one GPU each, never a trial without one.
    assert [env["CUDA_VISIBLE_DEVICES"] for env, _ in _slots(device_slots(base, 5))] == [
        "3", "5", "6"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus() == ["0", "1", "2"]
    # No GPU: each of 2 trials gets half of 8 cores, shared by its 2 processes.
    assert _slots(device_slots(base, 2, gpus=[], cores=8)) == [
        ({"OMP_NUM_THREADS": "2"}, {}), ({"OMP_NUM_THREADS": "2"}, {})]
