"""predict-flow: score a folder (or a Kaggle competition's test set) with a registered model.

    python -m flows.predict_flow '{"images": "path/to/folder"}'
    prefect deployment run predict-flow/champion --param images=path/to/folder

From Python: `predict_flow(images="path/to/folder", model_name="flowers")`. Writes
predictions.csv (path, label, probability, one column per class, error) and, for
dogs-vs-cats-redux, a Kaggle submission.csv; both go to an MLflow run of the predict-flow
experiment and the first rows to a Prefect table artifact. Each batch is compared with the
champion's own test split (`drift`; a `trainflow.scoring.drift` event when it drifted), and
with `shadow: challenger` the newest challenger scores it too, without writing predictions.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Literal

from prefect import flow
from prefect.runtime import flow_run
from pydantic import Field

from runtime.infrastructure import end_with_worker
from tasks.drift import check_drift
from tasks.preflight import check_mlflow
from tasks.score import Scores, find_images, publish_scores, resolve_model, score_images
from tasks.shadow import resolve_shadow, shadow_score
from training.config import DriftSpec
from training.storage import home


@flow(name="predict-flow", log_prints=True)
def predict_flow(images: str, model_name: str = "digits", alias: str = "champion",
                 subdir: str | None = None,
                 num_processes: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto",
                 drift: DriftSpec = DriftSpec(),  # noqa: B008  (frozen: a safe default)
                 shadow: Literal["challenger"] | None = None) -> Scores:
    """Score every image once with models:/MODEL_NAME@ALIAS, across this machine's processes.

    images: a folder (searched recursively), "kaggle:competitions/<slug>" (its test set) or
    "builtin:digits"; subdir: a folder inside it to score instead. drift: how the batch is
    compared with the model's test split. shadow: "challenger" to score the batch with the
    newest challenger too and record how often it agrees.
    """
    end_with_worker()  # runtime/infrastructure.py: a worker's flow runs end with it
    check_mlflow()
    run_dir = home() / "scoring" / str(flow_run.get_id())
    model = resolve_model(model_name, alias, run_dir / "model")
    challenger = resolve_shadow(model, run_dir / "shadow" / "model") if shadow else None
    found = find_images(images, subdir)
    scores = score_images(model, found, run_dir, num_processes,
                          drift.statistics_images if drift.check else 0)
    scores = publish_scores(model, found, scores)
    if drift.check:
        scores.drift = check_drift(model, scores, drift, run_dir / "drift")
    if challenger is not None:
        scores.shadow = shadow_score(model, challenger, found, scores, run_dir / "shadow",
                                     num_processes)
    return scores


if __name__ == "__main__":
    params = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    print(predict_flow(**params).model_dump_json(indent=2))
