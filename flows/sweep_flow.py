"""sweep-flow: an Optuna search over the training spec; the best trial goes through the gate.

    trainflow sweep --training.epochs 4 --n_trials 8 \
        --search_space '{"lr": {"log_uniform": [1e-4, 1e-1]}, "batch_size": {"choice": [32, 64]}}'
    prefect deployment run sweep-flow/digits-sweep

Takes train-flow's parameters (the training spec is the base each trial varies) and the
sweep's. Trials are nested MLflow runs under the sweep's run; the best complete trial alone is
evaluated on the test split and registered behind the same gate as train-flow. Run again
with the same parameters, it resumes the same study (storage: `storage`, or
$TRAINFLOW_HOME/optuna.db) and runs only the trials still missing.
"""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel

from flows.registration import register_and_review
from runtime.infrastructure import end_with_worker
from tasks.data import prepare_dataset, split_dataset
from tasks.decision import Registration
from tasks.evaluate import Evaluation, evaluate_model
from tasks.lineage import lineage_tags
from tasks.parameters import BLOCKS, resolve_parameters
from tasks.preflight import check_before_start
from tasks.sweep import SweepSummary, run_trials
from tasks.tracking import close_mlflow_run, failing_with_the_flow, open_mlflow_run
from training.config import (
    AuditSpec,
    DatasetSpec,
    RegistrySpec,
    SplitSpec,
    TrainingSpec,
)
from training.sweep_spec import Distribution, SweepSpec


class SweepResult(BaseModel):
    mlflow_run_id: str
    sweep: SweepSummary
    evaluation: Evaluation
    registration: Registration


# Parameters are validated in resolve_parameters, after the deployment's are laid under them.
@flow(name="sweep-flow", log_prints=True, validate_parameters=False)
def sweep_flow(  # noqa: PLR0913  (its parameters are the deployment form's fields)
    dataset: DatasetSpec,
    search_space: dict[str, Distribution],
    split: SplitSpec = SplitSpec(),  # noqa: B008  (frozen pydantic models: safe defaults)
    training: TrainingSpec = TrainingSpec(),  # noqa: B008
    registry: RegistrySpec = RegistrySpec(),  # noqa: B008
    audit: AuditSpec = AuditSpec(),  # noqa: B008
    n_trials: int = 8,
    max_concurrency: int = 1,
    budget_s: float | None = None,
    storage: str | None = None,
    pruning_warmup_epochs: int = 1,
) -> SweepResult:
    end_with_worker()  # runtime/infrastructure.py: a worker's flow runs end with it
    specs = resolve_parameters({"dataset": dataset, "split": split, "training": training,
                                "registry": registry, "audit": audit})
    dataset, split, training, registry, audit = (specs[k] for k in BLOCKS)
    sweep = SweepSpec(search_space=search_space, n_trials=n_trials,
                      max_concurrency=max_concurrency, budget_s=budget_s,
                      pruning_warmup_epochs=pruning_warmup_epochs)
    training = check_before_start(dataset, training)
    source = prepare_dataset(dataset)
    data = split_dataset(source, split, training, audit)
    run_id = open_mlflow_run(lineage_tags(dataset, split, training, registry, source, data), data,
                             flow_name="sweep-flow")
    with failing_with_the_flow(run_id):
        summary = run_trials(data, training, sweep, dataset.source, run_id, storage)
        best = summary.best
        lineage = lineage_tags(dataset, split, best.job.training, registry, source, data)
        evaluation = evaluate_model(best, summary.best_run_id)
        registration, _ = register_and_review(source, data, best, evaluation, registry,
                                              summary.best_run_id, lineage)
    close_mlflow_run(run_id, "FINISHED")
    return SweepResult(mlflow_run_id=run_id, sweep=summary, evaluation=evaluation,
                       registration=registration)

