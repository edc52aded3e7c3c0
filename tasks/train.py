"""train_model: run training under `accelerate launch`, watched, streamed and resumable."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from pydantic import BaseModel

from tasks import run_logger
from tasks.launcher import LaunchWatch, launch_command, launch_env, run_launch
from training.config import TrainingSpec, TrainJob
from training.storage import write_text_atomic
from training.tracking import RunLogger


class TrainResult(BaseModel):
    weights: Path
    best_epoch: int
    best_metrics: dict[str, float]
    history: list[dict[str, float]]
    world_size: int
    output_dir: Path
    mlflow_unsent: int = 0


def write_job(job: TrainJob) -> Path:
    path = job.output_dir / "job.json"
    write_text_atomic(path, job.model_dump_json(indent=2))
    return path


def run_training(job: TrainJob, logger, resume: bool = True,
                 on_epoch=lambda event: None, extra_env: dict[str, str] | None = None
                 ) -> TrainResult:
    """Launch training for `job` and return what it produced. Usable without Prefect.

    This process, not rank 0, logs the run's params and per-epoch metrics to MLflow, from the
    events rank 0 reports anyway: the ranks then never import MLflow or open its store
    (about 2.5 s of CPU on a SQLite store, taken from training on a small machine), and a
    tracking server that stalls or dies can only delay this watcher, never a rank.
    """
    tracker = RunLogger(job.mlflow_run_id, job.mlflow_tracking_uri, on_error=lambda message:
                        logger.warning("MLflow logging failed (training goes on): %s", message))
    job_path = write_job(job.model_copy(update={"mlflow_run_id": None}))
    spec = job.training
    args = ["--job", str(job_path)] + (["--resume"] if resume else [])
    command = launch_command(spec, "training.train", args)
    logger.info("launching: %s", " ".join(command))

    def on_event(event: dict) -> None:
        kind = event["event"]
        if kind == "params" and event["rank"] == 0:
            tracker.log_params(event["params"])
        elif kind == "epoch" and event["rank"] == 0:
            tracker.log_metrics(event["metrics"], step=event["epoch"])
            logger.info("epoch %s/%s %s", event["epoch"], event["epochs"], " ".join(
                f"{k}={v:.4g}" for k, v in event["metrics"].items()))
            on_epoch(event)
        elif kind == "start":
            logger.info("rank %s started on %s, world size %s", event["rank"], event["device"],
                        event["world_size"])
        elif kind == "resumed" and event["rank"] == 0:
            logger.info("resumed from %s (epoch %s done)", event["checkpoint"], event["epoch"])

    watch = LaunchWatch(on_line=lambda line: logger.info("%s", line), on_event=on_event,
                        hang_timeout_s=spec.hang_timeout_s, timeout_s=spec.timeout_s)
    try:
        events = run_launch(command, launch_env(extra_env), job.output_dir, watch)
    except BaseException:
        tracker.flush(timeout=10)  # keep what the finished epochs logged; do not delay the failure
        raise
    unsent = tracker.flush()
    done = [e for e in events if e["event"] == "done" and e["rank"] == 0]
    if not done:
        raise RuntimeError("training exited cleanly but rank 0 reported no result")
    result = done[-1]
    best = result["best"]
    return TrainResult(
        weights=Path(result["weights"]),
        best_epoch=best["epoch"],
        best_metrics={k: v for k, v in best.items() if k != "epoch"},
        history=result["history"],
        world_size=result["world_size"],
        output_dir=job.output_dir,
        mlflow_unsent=unsent,
    )


@task(retries=1, retry_delay_seconds=2, task_run_name="train-{training.model}")
def train_model(manifest: Path, training: TrainingSpec, output_dir: Path,
                mlflow_run_id: str | None, mlflow_tracking_uri: str | None) -> TrainResult:
    """Train under `accelerate launch`; a retry resumes from the last saved epoch."""
    logger = run_logger()
    job = TrainJob(manifest=manifest, training=training, output_dir=output_dir,
                   mlflow_run_id=mlflow_run_id, mlflow_tracking_uri=mlflow_tracking_uri)
    artifact_id = create_progress_artifact(progress=0.0, description="training epochs")

    def on_epoch(event: dict) -> None:
        update_progress_artifact(artifact_id, progress=100.0 * event["epoch"] / event["epochs"])

    result = run_training(job, logger, resume=True, on_epoch=on_epoch)
    if result.mlflow_unsent:
        logger.warning("%d metric batches could not be logged to MLflow; weights are safe at %s",
                       result.mlflow_unsent, result.weights)
    logger.info("best epoch %d: %s", result.best_epoch, json.dumps(result.best_metrics))
    return result
