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
    """Launch training for `job` and return what it produced. Usable without Prefect."""
    job_path = write_job(job)
    spec = job.training
    args = ["--job", str(job_path)] + (["--resume"] if resume else [])
    command = launch_command(spec, "training.train", args)
    logger.info("launching: %s", " ".join(command))

    def on_event(event: dict) -> None:
        kind = event["event"]
        if kind == "epoch" and event["rank"] == 0:
            logger.info("epoch %s/%s %s", event["epoch"], event["epochs"], " ".join(
                f"{k}={v:.4g}" for k, v in event["metrics"].items()))
            on_epoch(event)
        elif kind == "start":
            logger.info("rank %s started on %s, world size %s", event["rank"], event["device"],
                        event["world_size"])
        elif kind == "resumed" and event["rank"] == 0:
            logger.info("resumed from %s (epoch %s done)", event["checkpoint"], event["epoch"])
        elif kind == "mlflow_error":
            logger.warning("MLflow logging failed (training goes on): %s", event["message"])

    watch = LaunchWatch(on_line=lambda line: logger.info("%s", line), on_event=on_event,
                        hang_timeout_s=spec.hang_timeout_s, timeout_s=spec.timeout_s)
    events = run_launch(command, launch_env(extra_env), job.output_dir, watch)
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
        mlflow_unsent=result.get("mlflow_unsent", 0),
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
