"""train_model: run training under `accelerate launch`, watched, streamed and resumable."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import mlflow
from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from runtime.launcher import launch
from runtime.mlflow_logging import EpochLogger
from runtime.progress_display import LaunchProgress
from runtime.remote import (
    RemoteRootError,
    checkpoints_through,
    publish_run_outputs,
    remote_root,
    restore_run_outputs,
)
from tasks import RESUMABLE, run_logger
from tasks.tracking import fluent_mlflow
from trainflow_serving.model_names import network_library
from training.config import TrainingSpec
from training.engine.events import (
    EpochEnded,
    Event,
    Params,
    Predicted,
    Resumed,
    Started,
    Trained,
    last_from_rank_0,
)
from training.handoff import Preprocessing, SplitResult, TrainJob, TrainResult

SYSTEM_METRICS_INTERVAL_S = 2


def run_training(job: TrainJob, logger, resume: bool = True, on_epoch=lambda event: None,
                 extra_env: dict[str, str] | None = None, mlflow_run_id: str | None = None,
                 tracking_uri: str | None = None, evaluate_into: Path | None = None,
                 on_progress=lambda share: None) -> TrainResult:
    """Launch training for `job` and return what it produced. Usable without Prefect on one
    machine; on several (tasks/nodes.py) each machine's launch is a Prefect flow run.

    This process logs the run's params and per-epoch metrics to MLflow from the events rank 0
    reports (runtime/mlflow_logging.py says why not the ranks).
    """
    tracker = EpochLogger(mlflow_run_id, tracking_uri, on_error=lambda message: logger.warning(
        "MLflow logging failed (training went on): %s", message))
    job_file = job.save()
    args = ["--job", str(job_file)] + (["--resume"] if resume else [])
    if evaluate_into is not None:
        args += ["--evaluate-into", str(evaluate_into)]

    progress = LaunchProgress(logger, job.training.epochs, on_fraction=on_progress)
    on_event = reporting(logger, tracker, progress, on_epoch)

    try:
        with system_metrics(mlflow_run_id, tracking_uri, logger):
            if job.training.num_machines > 1:
                from tasks.nodes import launch_nodes  # needs a Prefect server and its workers

                warm_imports(job.training.model)
                events = launch_nodes(job, resume, logger, on_event)
            else:
                with checkpoints_in_bucket(job, resume, logger):
                    events = launch(job.training, "training.train", args, job.output_dir,
                                    logger, on_event, extra_env,
                                    on_started=lambda: warm_imports(job.training.model))
    except BaseException:
        tracker.flush(patience_s=0)  # what the finished epochs logged is kept even on failure
        raise
    finally:
        progress.close()
    return trained_result(job, events, unsent=tracker.flush())


def reporting(logger, tracker: EpochLogger, progress: LaunchProgress, on_epoch
              ) -> Callable[[Event], None]:
    """What each rank event becomes here: progress, MLflow params and metrics, log lines."""
    def on_event(event: Event) -> None:
        main = event.rank == 0
        progress.on_event(event)
        if isinstance(event, Params) and main:
            tracker.log_params(event.params)
        elif isinstance(event, EpochEnded) and main:
            figures = event.metrics.figures()
            tracker.log_metrics(figures, step=event.epoch)
            logger.info("epoch %s/%s %s", event.epoch, event.epochs, " ".join(
                f"{k}={v:.4g}" for k, v in figures.items()))
            on_epoch(event)
        elif isinstance(event, Started):
            logger.info("rank %s started on %s, world size %s", event.rank, event.device,
                        event.world_size)
        elif isinstance(event, Resumed) and main:
            logger.info("resumed from %s (epoch %s done)", event.checkpoint, event.epoch)

    return on_event


def trained_result(job: TrainJob, events: list[Event], unsent: int) -> TrainResult:
    """The TrainResult rank 0 reported; an error when it reported none."""
    result = last_from_rank_0(events, Trained)
    if result is None:
        raise RuntimeError("training exited cleanly but rank 0 reported no result")
    predicted = last_from_rank_0(events, Predicted)
    return TrainResult(
        job=job,
        preprocessing=Preprocessing.model_validate(result.preprocessing),
        weights=Path(result.weights),
        best_epoch=result.best.epoch,
        best_metrics=result.best,
        history=result.history,
        world_size=result.world_size,
        chosen_by=result.chosen_by,
        mlflow_unsent=unsent,
        test_dir=Path(predicted.out) if predicted else None,
    )


@contextlib.contextmanager
def checkpoints_in_bucket(job: TrainJob, resume: bool, logger) -> Iterator[None]:
    """With a remote root, one machine's checkpoints go to the bucket too: the flow run
    retried on another machine resumes from them (its disk may be gone with the first)."""
    remote = remote_root()
    if remote is None:
        yield
        return
    with checkpoints_through(remote, job, resume, logger):
        yield


def warm_imports(model_name: str) -> None:
    """Import, in a background thread, what this process needs once the ranks are done: the
    metrics, pictures and gate (scikit-learn, SciPy, matplotlib), the model check (torch and
    the network's library: torchvision's import alone is 1.7 s, torch._dynamo with it) and the
    model's logging (MLflow's pyfunc). The launcher's own start-up leaves a core idle for
    seconds; done afterwards they would wait on the critical path (about 9 s on 2 cores).
    Started once the launch's process exists: started before, they held this process's GIL
    while it was getting there (2-3 s later to the launch on 2 cores)."""
    def load() -> None:
        import importlib

        from training.evaluation.plots import pyplot

        with contextlib.suppress(Exception):  # an import that fails here fails where it is used
            for name in ("torch", "safetensors.torch", "sklearn.metrics", "scipy.stats",
                         "mlflow.pyfunc", network_library(model_name)):
                if name:
                    importlib.import_module(name)
            pyplot()
            # Logging a model checks its requirements against the installed packages through
            # a map of every installed distribution's modules, built on first use and cached
            # (about 2 s on 2 cores). Built here instead; if MLflow renames it, log_model
            # builds it as before (tests/test_library_internals.py holds MLflow to it).
            from mlflow.utils.requirements_utils import _init_packages_to_modules_map

            _init_packages_to_modules_map()

    threading.Thread(target=load, name="warm-imports", daemon=True).start()


def evaluation_dir(job: TrainJob) -> Path:
    """Where the test-split evaluation of this training goes (evaluate_model reads it)."""
    return job.output_dir.parent / "evaluation"


@contextlib.contextmanager
def system_metrics(run_id: str | None, tracking_uri: str | None, logger) -> Iterator[None]:
    """CPU, memory (and GPU, with nvidia-ml-py) of this machine during training, as the MLflow
    run's system/* metrics: MLflow's own monitor, started by `start_run(log_system_metrics=True)`.

    MLflow being unreachable costs the system metrics, never the training.
    """
    if run_id is None:
        yield
        return
    with fluent_mlflow(tracking_uri):
        try:
            mlflow.set_system_metrics_sampling_interval(SYSTEM_METRICS_INTERVAL_S)
            mlflow.start_run(run_id=run_id, nested=mlflow.active_run() is not None,
                             log_system_metrics=True)
        except Exception as e:
            logger.warning("no system metrics in MLflow for this training: %s", e)
            yield
            return
        try:
            yield
        finally:
            try:
                # Stops the monitor. The run stays open (RUNNING): whoever opened it (the
                # flow, a sweep trial) ends it with its outcome.
                mlflow.end_run("RUNNING")
            except Exception as e:
                logger.warning("MLflow did not take the end of the system metrics: %s", e)


@task(retries=1, retry_delay_seconds=2, task_run_name="train-{training.model}", **RESUMABLE)
def train_model(split: SplitResult, training: TrainingSpec, output_dir: Path,
                mlflow_run_id: str | None, tracking_uri: str | None,
                metric: str = "accuracy") -> TrainResult:
    """Train under `accelerate launch`, keeping the epoch best on the gate's `metric`; a retry
    resumes from the last saved epoch."""
    logger = run_logger()
    job = TrainJob(split=split, training=training, output_dir=output_dir, metric=metric)
    if warning := imbalance_warning(split, metric):
        logger.warning("%s", warning)
    artifact_id = create_progress_artifact(progress=0.0, description="training epochs")

    def on_progress(share: float) -> None:
        update_progress_artifact(artifact_id, progress=100.0 * share)

    result = run_training(job, logger, resume=True, on_progress=on_progress,
                          mlflow_run_id=mlflow_run_id, tracking_uri=tracking_uri,
                          evaluate_into=evaluation_dir(job))
    if result.mlflow_unsent:
        logger.warning("%d metric batches could not be logged to MLflow; weights are safe at %s",
                       result.mlflow_unsent, result.weights)
    best = result.best_metrics  # its every figure was on that epoch's line
    logger.info("kept epoch %d of %d (%s): val_accuracy=%.4g val_loss=%.4g", result.best_epoch,
                len(result.history), result.how_chosen(), best.val_accuracy, best.val_loss)
    if (remote := remote_root()) is not None:
        logger.info("best weights in %s: %s", remote, publish_run_outputs(remote, output_dir))
    return result


IMBALANCE = 10
"""Largest over smallest class in the train split above which accuracy misleads the gate."""


def imbalance_warning(split: SplitResult, metric: str) -> str | None:
    """A line for unbalanced classes judged on accuracy, naming what to use instead."""
    counts = {name: n for name, n in split.counts["train"].items() if n}
    if len(counts) < 2 or metric != "accuracy":
        return None
    (large, most), (small, least) = (max(counts.items(), key=lambda c: c[1]),
                                     min(counts.items(), key=lambda c: c[1]))
    if most <= IMBALANCE * least:
        return None
    return (f"unbalanced classes: {large!r} has {most / least:.0f}x the train images of "
            f"{small!r} ({most} against {least}), and the gate compares accuracy, which a model "
            "that ignores the rare class can win: set registry.metric to balanced_accuracy or "
            "macro_f1, and training.class_weights to balanced")


@task
def bring_outputs_here(trained: TrainResult) -> None:
    """With a remote root, a flow run retried on another machine after its training ended finds
    the train stage's result in the bucket but not its files: fetch the best weights (and the
    evaluation's files, when it ended too) before a stage reads them. Not cached."""
    remote = remote_root()
    if remote is None or trained.weights.exists():
        return
    run_dir = trained.job.output_dir.parent
    fetched = restore_run_outputs(remote, run_dir)
    if not trained.weights.exists():
        raise RemoteRootError(f"the best weights of this run are neither at {trained.weights} "
                              f"nor in {remote}; run the flow again with `force` to train anew")
    run_logger().info("fetched %s of this run from %s into %s", " and ".join(fetched), remote,
                      run_dir)
