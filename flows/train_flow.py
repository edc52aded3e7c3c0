"""train-flow: prepare -> split -> train (accelerate launch) -> evaluate -> register.

    trainflow train                                  # the built-in digits dataset
    trainflow train --config run.yaml --training.epochs 3
    prefect deployment run train-flow/digits         # through a Prefect server and worker

From Python: `train_flow(dataset={"source": "builtin:digits"}, training={"epochs": 1})`.
This module only composes tasks; what each stage does lives in tasks/ and training/.
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel

from flows.registration import register_and_review
from runtime.infrastructure import end_with_worker
from runtime.remote import bucket_results
from tasks.data import bring_data_here, prepare_dataset, split_dataset
from tasks.decision import Registration
from tasks.evaluate import Evaluation, evaluate_model
from tasks.gate import score_champion_early
from tasks.lineage import FLOW_RUN_URL, find_unchanged_champion, lineage_tags
from tasks.parameters import BLOCKS, resolve_parameters
from tasks.preflight import check_before_start
from tasks.report import publish_report
from tasks.review import Review
from tasks.tracking import close_mlflow_run, failing_with_the_flow, open_mlflow_run, run_url
from tasks.train import bring_outputs_here, train_model
from training.config import AuditSpec, DatasetSpec, RegistrySpec, RetrainSpec, SplitSpec, TrainingSpec
from training.handoff import TrainResult
from training.storage import home, tracking_uri


class FlowResult(BaseModel):
    mlflow_run_id: str | None = None
    mlflow_url: str | None = None
    prefect_url: str | None = None
    skipped: str | None = None
    trained: TrainResult | None = None
    evaluation: Evaluation | None = None
    registration: Registration | None = None
    review: Review | None = None


# Parameters are validated in resolve_parameters, after the deployment's are laid under them.
# With TRAINFLOW_REMOTE_ROOT the finished stages' results are kept in the bucket: a run retried
# on another machine skips them (runtime/remote.py).
@flow(name="train-flow", log_prints=True, validate_parameters=False,
      **bucket_results())
def train_flow(
    dataset: DatasetSpec,
    split: SplitSpec = SplitSpec(),  # noqa: B008  (frozen pydantic models: safe defaults)
    training: TrainingSpec = TrainingSpec(),  # noqa: B008
    registry: RegistrySpec = RegistrySpec(),  # noqa: B008
    audit: AuditSpec = AuditSpec(),  # noqa: B008
    force: bool = False,
    retrain: RetrainSpec = RetrainSpec(),  # noqa: B008  (read by watch-data, not by the run)
) -> FlowResult:
    end_with_worker()  # runtime/infrastructure.py: a worker's flow runs end with it
    specs = resolve_parameters({"dataset": dataset, "split": split, "training": training,
                                "registry": registry, "audit": audit})
    dataset, split, training, registry, audit = (specs[k] for k in BLOCKS)
    training = check_before_start(dataset, training)
    source = prepare_dataset(dataset)
    data = split_dataset(source, split, training, audit)
    bring_data_here(source, data)  # a retry on another machine: the files of the stages above
    lineage = lineage_tags(dataset, split, training, registry, source, data)
    if not force and (version := find_unchanged_champion(registry.model_name, lineage)):
        return FlowResult(skipped=f"champion v{version} already trained on this data and spec")
    run_id = open_mlflow_run(lineage, data)
    # The champion is scored on this run's test images while the challenger trains.
    champion_scored = score_champion_early.submit(data, training, registry)
    with failing_with_the_flow(run_id):
        run_dir = home() / "runs" / str(flow_run.get_id())
        trained = train_model(data, training, run_dir / "train", run_id, tracking_uri(),
                              registry.metric)
        bring_outputs_here(trained)  # a retry on another machine: the weights, the evaluation
        evaluation = evaluate_model(trained, run_id)
        champion_scored.wait()  # the gate finds its predictions in its cache
        registration, review = register_and_review(source, data, trained, evaluation,
                                                   registry, run_id, lineage)
        publish_report(source, data, trained, evaluation, registration, run_id)
    close_mlflow_run(run_id, "FINISHED")
    return FlowResult(mlflow_run_id=run_id, mlflow_url=run_url(run_id),
                      prefect_url=lineage.get(FLOW_RUN_URL), trained=trained,
                      evaluation=evaluation, registration=registration, review=review)

