"""The flow run's markdown summary artifact, and the retrain-skip lookup."""

from __future__ import annotations

from mlflow import MlflowClient
from prefect import task
from prefect.artifacts import create_markdown_artifact

from tasks import run_logger
from tasks.evaluate import Evaluation
from tasks.register import CHAMPION, Registration, champion_version
from tasks.tracking import run_url
from tasks.train import TrainResult
from training.datasets import DatasetRef
from training.split import SplitResult
from training.storage import tracking_uri


@task
def find_unchanged_champion(model_name: str, fingerprint: str, spec_hash: str) -> str | None:
    """The champion version when it was trained on this very data and spec, else None."""
    champion = champion_version(MlflowClient(tracking_uri()), model_name)
    if champion is None:
        return None
    same = (champion.tags.get("dataset_fingerprint") == fingerprint
            and champion.tags.get("spec_hash") == spec_hash)
    if same:
        run_logger().info(
            "skipping training: %s@%s (v%s) was trained on the same dataset fingerprint %s and "
            "training spec; pass force=true to retrain anyway", model_name, CHAMPION,
            champion.version, fingerprint[:12])
    return str(champion.version) if same else None


@task
def publish_report(dataset: DatasetRef, split: SplitResult, trained: TrainResult,
                   evaluation: Evaluation, registration: Registration, mlflow_run_id: str) -> str:
    """A markdown artifact on the flow run: data, split, best epoch, test metrics, decision."""
    counts = " | ".join(f"{name}: {sum(c.values())}" for name, c in split.counts.items())
    rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in evaluation.metrics.items())
    markdown = f"""# train-flow result

**Dataset** `{dataset.source}`: {dataset.image_count} images, {len(dataset.class_names)} classes,
fingerprint `{dataset.fingerprint[:12]}`; split {counts}; quarantined {split.quarantined}.

**Training** world size {trained.world_size}, best epoch {trained.best_epoch}
(val accuracy {trained.best_metrics['val_accuracy']:.4f}).

| test metric | value |
|---|---|
{rows}

**Registry** `{registration.model_name}` v{registration.version}, aliases
{', '.join(registration.aliases) or 'none'}: **{'promoted' if registration.promoted
else 'not promoted'}**, {registration.reason}.

[MLflow run]({run_url(mlflow_run_id)})
"""
    create_markdown_artifact(markdown=markdown, key="train-flow-report",
                             description="train-flow summary")
    return markdown
