"""review_version: the review report and the model card of a version the gate just judged.

The report (training/evaluation/review.py) puts the challenger beside the champion it was
compared with, on the same test images, from the predictions the gate already holds; the card
says what the version is from what the run recorded. Both go to the MLflow run of the version
(`review/`), the card also to the version's description (below the gate's sentence), and the
report's top lines to a Prefect artifact and to the approval form.
"""

from __future__ import annotations

import re
from pathlib import Path

from mlflow import MlflowClient
from prefect import task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from tasks import MLFLOW_RETRIES, run_logger
from tasks.decision import Registration
from tasks.evaluate import Evaluation
from tasks.gate import champion_predictions
from tasks.lineage import FLOW_RUN_ID, FLOW_RUN_URL, GIT_COMMIT, GIT_DIRTY
from tasks.register import CARD_MARKER
from tasks.report import how_split
from tasks.tracking import run_url
from training.data.sources import DatasetRef
from training.evaluation.review import (
    ModelAnswers,
    compare,
    read_challenger,
    read_served,
    summary_markdown,
    write_review,
)
from training.handoff import SplitResult, TrainResult
from training.storage import tracking_uri

REVIEW_TAG = "trainflow.review_url"


class Review(BaseModel):
    summary: str
    """The report's top lines (markdown)"""
    url: str
    """The report in the MLflow UI"""
    folder: Path


def artifact_key(model_name: str, version: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) for a model version."""
    return f"review-{re.sub(r'[^a-z0-9]+', '-', model_name.lower()).strip('-')}-v{version}"


def _interval(figure: dict) -> str:
    return f"{figure['value']:.4f} [{figure['low']:.4f}, {figure['high']:.4f}]"


def model_card(source: DatasetRef, split: SplitResult, trained: TrainResult,
               evaluation: Evaluation, registration: Registration, figures: dict,
               lineage: dict[str, str]) -> str:
    """The version's card, from what the run recorded."""
    t, names = trained.job.training, trained.class_names
    challenger = figures["models"][0]
    per_class = challenger["per_class"]
    counts = "\n".join(f"| {name} | " + " | ".join(str(split.counts[s].get(name, 0))
                                                  for s in ("train", "val", "test")) + " |"
                       for name in names)
    macro = evaluation.metrics["macro_f1"]
    weak = sorted((c["f1"]["value"], name) for name, c in per_class.items())
    weak = [f"{name} (F1 {_interval(per_class[name]['f1'])})" for f1, name in weak
            if per_class[name]["f1"]["high"] < macro][:5]
    commit = lineage.get(GIT_COMMIT, "unknown") + (
        " (with uncommitted changes)" if lineage.get(GIT_DIRTY) == "true" else "")
    weights = ("from scratch" if not t.starts_from_weights
               else f"fine-tuned from {'pretrained weights' if t.pretrained else t.weights}")
    f1_rows = "\n".join(f"| {name} | {_interval(per_class[name]['f1'])} | "
                        f"{per_class[name]['support']} |" for name in names)
    return f"""## Model card: {registration.model_name} v{registration.version}

**Intended use.** Sorts an image into one of {len(names)} classes ({', '.join(names)}), as
they appear in `{source.source}`. Images unlike those were not measured.

**Training data.** `{source.source}`, fingerprint `{source.fingerprint[:12]}`,
{source.image_count} images, {how_split(split)}; {split.quarantined} quarantined.

| class | train | val | test |
|---|---|---|---|
{counts}

**Recipe.** `{t.model}` {weights}; {t.image_size} px ({t.fit}), augment {t.augment};
{t.optimizer} lr {t.lr}, batch {t.batch_size} per process, world size {trained.world_size};
kept epoch {trained.best_epoch} of {len(trained.history)}, chosen {trained.how_chosen()}.

**Test figures** on {evaluation.images} images (bootstrap 95% intervals): accuracy
{_interval(challenger['accuracy'])}, macro F1 {macro:.4f}, expected calibration error
{challenger['calibration']['ece']:.4f}.

| class | F1 | images |
|---|---|---|
{f1_rows}

**Known weak classes.** {', '.join(weak) or 'none below the macro F1 beyond noise'}.

**Lineage.** commit `{commit}`; flow run `{lineage.get(FLOW_RUN_ID, '?')}`
({lineage.get(FLOW_RUN_URL, 'no URL')}); the gate: {registration.reason}.

**How to load.**

```python
import mlflow, pandas as pd
model = mlflow.pyfunc.load_model("models:/{registration.model_name}/{registration.version}")
model.predict(pd.DataFrame({{"image": [open("picture.jpg", "rb").read()]}}))
```
"""


@task(**MLFLOW_RETRIES)
def review_version(source: DatasetRef, split: SplitResult, trained: TrainResult,
                   evaluation: Evaluation, registration: Registration, mlflow_run_id: str,
                   lineage: dict[str, str]) -> Review:
    """The review report and the model card, logged where a person deciding will look."""
    names = trained.class_names
    paths, truth, predicted, confidence = read_challenger(evaluation.predictions, names)
    models = [ModelAnswers(f"challenger v{registration.version}", predicted, confidence)]
    if registration.champion_version is not None:
        scored = champion_predictions(registration.model_name, registration.champion_version,
                                      split)
        if scored is not None:
            models.append(ModelAnswers(f"champion v{registration.champion_version}",
                                 *read_served(scored, paths, names)))
    figures = compare(truth, models, names)
    decision = registration.description()
    out = evaluation.output_dir.parent / "review"
    write_review(out, decision, figures, paths, split.root, truth, models,
                 split.audit.file if split.audit else None)
    card = model_card(source, split, trained, evaluation, registration, figures, lineage)
    (out / "model_card.md").write_text(card)
    client = MlflowClient(tracking_uri())
    client.log_artifacts(mlflow_run_id, str(out), artifact_path="review")
    url = f"{run_url(mlflow_run_id)}/artifacts/review/review.html"
    client.set_model_version_tag(registration.model_name, registration.version, REVIEW_TAG,
                                 url)
    client.update_model_version(registration.model_name, registration.version,
                                description=decision + CARD_MARKER + card)
    summary = summary_markdown(decision, figures)
    create_markdown_artifact(
        markdown=f"# Review of {registration.model_name} v{registration.version}\n\n{summary}"
        f"\n\n[The whole report: per class, calibration, confusion, the images that changed]"
        f"({url})\n\n{card}", key=artifact_key(registration.model_name, registration.version),
        description=f"{registration.model_name} v{registration.version} against its champion")
    run_logger().info("review of v%s: %s", registration.version, url)
    return Review(summary=summary, url=url, folder=out)
