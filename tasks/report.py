"""The flow run's markdown summary artifact."""

from __future__ import annotations

from mlflow import MlflowClient
from prefect import task
from prefect.artifacts import create_markdown_artifact

from tasks.decision import Registration
from tasks.evaluate import Evaluation
from tasks.tracking import run_url
from training.data.sources import DatasetRef
from training.handoff import SplitResult, TrainResult
from training.storage import tracking_uri


def how_split(split: SplitResult) -> str:
    if split.given_splits is None:
        return "split by the flow, stratified"
    folders = ", ".join(f"{folder}/ as {name}" for folder, name in split.given_splits.items())
    carved = "" if "val" in split.given_splits.values() else "; val carved from train"
    return f"as given: {folders}{carved}"


def audit_line(split: SplitResult) -> str:
    if split.audit is None:
        return ""
    return (f"\n\n**Data audit** {split.audit.summary}: `audit/audit.json` in the MLflow run "
            "lists every image found.")


@task
def publish_report(dataset: DatasetRef, split: SplitResult, trained: TrainResult,
                   evaluation: Evaluation, registration: Registration, mlflow_run_id: str) -> str:
    """A markdown artifact on the flow run: data, split, best epoch, test metrics, decision."""
    counts = " | ".join(f"{name}: {sum(c.values())}" for name, c in split.counts.items())
    rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in evaluation.metrics.items())
    markdown = f"""# train-flow result

**Dataset** `{dataset.source}`: {dataset.image_count} images, {len(dataset.class_names)} classes,
fingerprint `{dataset.fingerprint[:12]}`; split {counts} ({how_split(split)}); quarantined
{split.quarantined}.{audit_line(split)}

**Training** world size {trained.world_size}, kept epoch {trained.best_epoch} of
{len(trained.history)}, chosen {trained.how_chosen()} (val accuracy
{trained.best_metrics.val_accuracy:.4f}).

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
    # The same report is the MLflow run's description: the system tag that
    # `start_run(description=...)` sets and the run page shows.
    MlflowClient(tracking_uri()).set_tag(mlflow_run_id, "mlflow.note.content", markdown)
    return markdown
