"""run_trials: an Optuna study whose trials are ordinary training launches, pruned on epochs.

Each trial is `run_training`, the train task's own launcher path (kill, hang, timeout and
error guarantees included), logging into a nested MLflow run under the sweep's run. Rank 0's
epoch events feed the trial's validation accuracy to Optuna's pruner as they arrive; a trial
the pruner stops has its launch killed cleanly and is recorded PRUNED, not failed. The study
lives in an Optuna storage (SQLite under the home folder by default), so a sweep killed half
way resumes without redoing finished trials.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import tempfile
import time
from pathlib import Path

import mlflow
import optuna
import sqlalchemy.exc
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from optuna.trial import TrialState
from prefect import task
from pydantic import BaseModel, ValidationError

from runtime.launcher import LaunchFailed
from tasks import run_logger
from tasks.tracking import fluent_mlflow
from tasks.train import run_training
from training.config import TrainingSpec
from training.engine.events import EpochEnded
from training.handoff import SplitResult, TrainJob, TrainResult
from training.hardware import cuda_gpu_count
from training.storage import home, tracking_uri
from training.sweep_spec import Distribution, SweepSpec

RESULT_ATTR, RUN_ATTR, EPOCHS_ATTR = "trainflow.result", "trainflow.mlflow_run_id", "epochs_run"
TRIAL_STATE = "trainflow.trial_state"


class SweepSummary(BaseModel):
    study_name: str
    storage: str
    trials: dict[str, int]
    """state (COMPLETE, PRUNED, FAIL) -> trials"""
    epochs_not_run: int
    """epochs the pruned trials did not train, against running every trial to the end"""
    best_params: dict
    best_value: float
    best: TrainResult
    best_run_id: str


def study_name(source: str, data: SplitResult, base: TrainingSpec, sweep: SweepSpec) -> str:
    """The same sweep (data, base spec, space, size) finds its study again after a kill."""
    key = json.dumps([source, data.manifest_sha256, base.model_dump(mode="json"),
                      sweep.model_dump(mode="json", exclude={"max_concurrency", "budget_s"})],
                     sort_keys=True)
    return "sweep-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def default_storage() -> str:
    return f"sqlite:///{home() / 'optuna.db'}"


def open_storage(url: str, attempts: int = 8) -> optuna.storages.RDBStorage:
    """The study storage at `url`, safe when several processes create it at the same moment.

    Optuna creates its tables and stamps the schema version on first open, unguarded: two
    sweeps (or a sweep and anything reading its storage) starting together on a new SQLite
    file lose with `UNIQUE constraint failed: alembic_version.version_num` or `table ...
    already exists` (measured: 10 of 20 rounds of three processes). The winner leaves a
    complete schema, so opening again succeeds.
    """
    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url)
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.1 * (attempt + 1))
    raise AssertionError("unreachable")


def suggest(trial: optuna.Trial, name: str, dist: Distribution):
    if dist.log_uniform:
        return trial.suggest_float(name, *dist.log_uniform, log=True)
    if dist.uniform:
        return trial.suggest_float(name, *dist.uniform)
    if dist.int_range:
        return trial.suggest_int(name, *dist.int_range)
    return trial.suggest_categorical(name, dist.choice)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, named as CUDA_VISIBLE_DEVICES names them (indices or
    UUIDs); a trial's CUDA_VISIBLE_DEVICES must be a subset of these, never 0..n-1 blindly."""
    count = cuda_gpu_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    names = [d.strip() for d in listed.split(",") if d.strip()] if listed else []
    return (names or [str(i) for i in range(count)])[:count]


def device_slots(base: TrainingSpec, concurrency: int, gpus: list[str] | None = None,
                 cores: int | None = None) -> queue.Queue:
    """What each concurrent trial may use.

    GPUs: the visible ones shared out in contiguous groups, the leftovers going one each to the
    first groups, and never more slots than GPUs (a trial without a GPU would train silently on
    the CPU). CPU: the base spec's processes, with this machine's cores divided among the
    concurrent trials.
    """
    gpus = visible_gpus() if gpus is None else gpus
    slots: queue.Queue = queue.Queue()
    if gpus:
        groups = min(concurrency, len(gpus))
        size, extra = divmod(len(gpus), groups)
        start = 0
        for i in range(groups):
            mine = gpus[start:start + size + (i < extra)]
            start += len(mine)
            slots.put(({"CUDA_VISIBLE_DEVICES": ",".join(mine)}, {"num_processes": len(mine)}))
        return slots
    cores = cores or len(os.sched_getaffinity(0))
    per_trial = max(1, cores // concurrency)
    threads = max(1, per_trial // base.resolved_num_processes())
    for _ in range(concurrency):
        slots.put(({"OMP_NUM_THREADS": str(threads)}, {}))
    return slots


def fail_interrupted(study: optuna.Study) -> int:
    """Trials left RUNNING by a sweep process that was killed: failed, so they are not counted."""
    stale = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]
    for t in stale:
        study.tell(t.number, state=TrialState.FAIL)
    return len(stale)


def trial_spec(base: TrainingSpec, params: dict, launch: dict) -> TrainingSpec:
    """A trial's spec: the sweep's, with the trial's values and its launch's place. Only the
    fields the sweep set are carried, so a default that follows another field (lr follows
    model) follows the trial's value of it."""
    return TrainingSpec(**{**base.model_dump(exclude_unset=True), **params, **launch})


@task
def run_trials(data: SplitResult, base: TrainingSpec, sweep: SweepSpec, source: str,
               parent_run_id: str, storage: str | None = None) -> SweepSummary:
    """Run the study's remaining trials; the best complete trial's result for evaluation."""
    logger = run_logger()
    storage = storage or default_storage()
    name = study_name(source, data, base, sweep)
    study = optuna.create_study(
        study_name=name, storage=open_storage(storage), direction="maximize", load_if_exists=True,
        sampler=optuna.samplers.TPESampler(seed=base.seed),
        # Epochs are steps 1, 2, ...; Optuna prunes from step n_warmup_steps on.
        pruner=optuna.pruners.MedianPruner(n_startup_trials=sweep.pruning_startup_trials,
                                           n_warmup_steps=sweep.pruning_warmup_epochs + 1))
    if not study.trials and (base_values := sweep.base_trial(base)):
        study.enqueue_trial(base_values)
    if stale := fail_interrupted(study):
        logger.warning("%d trials of an interrupted run of this sweep were marked failed", stale)
    finished = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    remaining = sweep.n_trials - len(finished)
    logger.info("study %s in %s: %d trials finished, %d to run", name, storage, len(finished),
                max(0, remaining))
    client = MlflowClient(tracking_uri())
    experiment = client.get_run(parent_run_id).info.experiment_id
    slots = device_slots(base, sweep.max_concurrency)
    if (trials_at_once := slots.qsize()) < sweep.max_concurrency:
        logger.warning("max_concurrency %d is above the %d visible GPUs: %d trials at once, "
                       "one GPU or more each", sweep.max_concurrency, trials_at_once,
                       trials_at_once)
    folder = home() / "sweeps" / name

    def objective(trial: optuna.Trial) -> float:
        params = {field: suggest(trial, field, dist) for field, dist in sweep.search_space.items()}
        env, launch = slots.get()
        try:
            spec = trial_spec(base, params, launch)
            pruned = None
            # Nested under the sweep's run; ended FINISHED on a result (pruning is one), FAILED
            # when the trial raised.
            with mlflow.start_run(experiment_id=experiment, run_name=f"trial-{trial.number}",
                                  parent_run_id=parent_run_id,
                                  tags={"trainflow.study": name}) as child:
                trial.set_user_attr(RUN_ATTR, child.info.run_id)
                try:
                    return train_trial(trial, spec, data, folder, env, child.info.run_id, client,
                                       logger)
                except optuna.TrialPruned as e:
                    pruned = e
            raise pruned
        finally:
            slots.put((env, launch))

    if remaining > 0:
        with fluent_mlflow(tracking_uri()):  # the trials' runs are opened with the fluent API
            study.optimize(objective, n_trials=remaining, n_jobs=slots.qsize(),
                           timeout=sweep.budget_s, catch=(LaunchFailed, ValidationError))
    return summarize(study, base, storage, client, parent_run_id)


def train_trial(trial: optuna.Trial, spec: TrainingSpec, data: SplitResult, folder: Path,
                env: dict, run_id: str, client: MlflowClient, logger) -> float:
    epochs_run = 0

    def on_epoch(event: EpochEnded) -> None:
        nonlocal epochs_run
        epochs_run = event.epoch
        trial.report(event.metrics.val_accuracy, step=event.epoch)
        if trial.should_prune():  # raised in the watcher: the launch is killed on the way out
            raise optuna.TrialPruned(f"pruned after epoch {event.epoch}")

    job = TrainJob(split=data, training=spec, output_dir=folder / f"trial-{trial.number}")
    try:
        result = run_training(job, logger, resume=False, on_epoch=on_epoch, extra_env=env,
                              mlflow_run_id=run_id, tracking_uri=tracking_uri())
    except optuna.TrialPruned:
        trial.set_user_attr(EPOCHS_ATTR, epochs_run)
        client.set_tag(run_id, TRIAL_STATE, "pruned")
        logger.info("trial %d pruned after epoch %d", trial.number, epochs_run)
        raise
    except BaseException:
        client.set_tag(run_id, TRIAL_STATE, "failed")
        raise
    trial.set_user_attr(EPOCHS_ATTR, len(result.history))
    trial.set_user_attr(RESULT_ATTR, result.model_dump_json())
    client.set_tag(run_id, TRIAL_STATE, "complete")
    return result.best_metrics.val_accuracy


def summarize(study: optuna.Study, base: TrainingSpec, storage: str, client: MlflowClient,
              parent_run_id: str) -> SweepSummary:
    """Counts, the best trial, and the study's story on the parent MLflow run."""
    trials = study.trials
    counts = {state.name: sum(1 for t in trials if t.state == state)
              for state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if not complete:
        raise RuntimeError(f"no trial of study {study.study_name} completed ({counts}); see "
                           "the failed trials' runs in MLflow")
    best = max(complete, key=lambda t: (t.value, -t.number))
    not_run = sum(base.epochs - t.user_attrs.get(EPOCHS_ATTR, 0)
                  for t in trials if t.state == TrialState.PRUNED)
    now = int(time.time() * 1000)
    client.log_batch(parent_run_id, params=[Param(f"best.{k}", str(v))
                                            for k, v in best.params.items()],
                     metrics=[Metric(k, float(v), now, 0) for k, v in {
                         "best_val_accuracy": best.value, "trials_complete": counts["COMPLETE"],
                         "trials_pruned": counts["PRUNED"], "trials_failed": counts["FAIL"],
                         "epochs_not_run": not_run}.items()])
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "trials.csv"
        study.trials_dataframe().to_csv(table, index=False)
        client.log_artifact(parent_run_id, str(table), "study")
        if len(complete) >= 2:
            picture = Path(tmp) / "parallel_coordinates.png"
            parallel_coordinates(study, picture)
            client.log_artifact(parent_run_id, str(picture), "study")
    return SweepSummary(study_name=study.study_name, storage=storage, trials=counts,
                        epochs_not_run=not_run, best_params=best.params, best_value=best.value,
                        best=TrainResult.model_validate_json(best.user_attrs[RESULT_ATTR]),
                        best_run_id=best.user_attrs[RUN_ATTR])


def parallel_coordinates(study: optuna.Study, path: Path) -> None:
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with warnings.catch_warnings():  # optuna marks its matplotlib plots experimental
        warnings.simplefilter("ignore")
        axes = optuna.visualization.matplotlib.plot_parallel_coordinate(study)
    axes.figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(axes.figure)
