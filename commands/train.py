"""`trainflow train` and `trainflow run`: train-flow from the command line, typed.

    trainflow train --training.epochs 5 --training.model resnet18
    trainflow train --config digits.yaml --training.lr 0.003        # flags beat the file
    trainflow run train-flow/dogs-vs-cats --training.epochs 2       # through a worker

Flags are generated from the flow's parameter models (pydantic-settings' CLI), so
`--help` lists every field with its type, default and description, and a bad value is refused
with the model's own message before any server starts. `--config` takes the shape of a
deployment's `parameters:` in prefect.yaml. `train` runs here, on PREFECT_API_URL or the reused
local server, and prints a summary (`--json`: the whole result); `run` starts a deployment's
run with only the fields given, each laid over the deployment's own value.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from pydantic import AliasChoices, BaseModel, Field, ValidationError, field_validator
from pydantic_settings import CliApp, CliPositionalArg

from training.config import (
    BLOCKS,
    AuditSpec,
    DatasetSpec,
    InvalidParameters,
    RegistrySpec,
    SplitSpec,
    TrainingSpec,
    merge_blocks,
    problems_of,
    validate_blocks,
)
from training.storage import redacted, tracking_uri
from training.sweep_spec import Distribution, check_search_space


class TrainArgs(BaseModel):
    """Train, evaluate and register a model with train-flow, on this machine."""

    config: Path | None = Field(
        None, description="A YAML file of parameter blocks, as a deployment's parameters in "
        "prefect.yaml (dataset:, split:, training:, registry:, audit:); flags override its "
        "fields.")
    dataset: DatasetSpec = DatasetSpec(source="builtin:digits")
    split: SplitSpec = SplitSpec()
    training: TrainingSpec = TrainingSpec()
    registry: RegistrySpec = RegistrySpec()
    audit: AuditSpec = AuditSpec()
    force: bool = Field(False, description="Train even when the champion was trained on the "
                        "same data and spec.")
    json_output: bool = Field(False, validation_alias=AliasChoices("json", "json_output"),
                              description="Print the whole result as JSON, not the summary.")


class SweepArgs(TrainArgs):
    """Search the training spec with Optuna (sweep-flow); the best trial goes through the gate."""

    search_space: dict[str, Distribution] = Field(
        description='Training fields to vary, as JSON, e.g. \'{"lr": {"log_uniform": [1e-4, '
        '1e-1]}, "batch_size": {"choice": [32, 64]}}\'.')
    n_trials: int = Field(8, ge=1, description="Trials in the study, all runs together.")
    max_concurrency: int = Field(1, ge=1, description="Trials at once.")
    budget_s: float | None = Field(None, gt=0, description="Start no new trial after this long.")
    storage: str | None = Field(None, description="Optuna storage URL (default: the home's).")

    @field_validator("search_space")
    @classmethod
    def _searchable(cls, space: dict) -> dict:
        return check_search_space(space)  # the flow's own rule


class RunArgs(BaseModel):
    """Run a deployment through its work pool with some fields changed; every other field keeps
    the deployment's value."""

    deployment: CliPositionalArg[str] = Field(description='e.g. "train-flow/digits"')
    dataset: DatasetSpec | None = None
    split: SplitSpec | None = None
    training: TrainingSpec | None = None
    registry: RegistrySpec | None = None
    audit: AuditSpec | None = None
    watch: bool = Field(False, description="Wait for the run to finish.")


def parse(model: type[BaseModel], argv: list[str], prog: str) -> tuple[BaseModel, dict]:
    """The model from argv, and the blocks' fields that argv names (typed); a bad value exits
    with its message (no traceback)."""
    from pydantic_settings import CliSettingsSource

    source = CliSettingsSource(model, cli_prog_name=prog, cli_implicit_flags=True,
                               cli_kebab_case=False)
    try:
        args = CliApp.run(model, cli_args=argv, cli_settings_source=source)
        # The parsed model counts every default as set; the source knows what was typed. The
        # values are the parsed (validated) ones: nothing is validated twice.
        typed = source(args=argv)()
        given = {name: getattr(args, name).model_dump(mode="json", include=set(typed[name]))
                 for name in BLOCKS if isinstance(typed.get(name), dict)}
    except ValidationError as e:
        sys.exit(f"{prog}: invalid parameters\n" + "\n".join(f"  {p}" for p in problems_of(e)))
    return args, given


def train_parameters(args: TrainArgs, given: dict) -> dict:
    """The flow's parameters: defaults, under the config file, under the flags."""
    base: dict = {"dataset": {"source": "builtin:digits"}}
    if args.config is not None:
        import yaml

        try:
            loaded = yaml.safe_load(args.config.read_text()) or {}
        except OSError as e:
            sys.exit(f"trainflow train: cannot read --config {args.config}: {e.strerror}")
        except yaml.YAMLError as e:
            sys.exit(f"trainflow train: --config {args.config} is not YAML or JSON: "
                     f"{' '.join(str(e).split())}")
        if not isinstance(loaded, dict):
            sys.exit(f"trainflow train: --config {args.config} holds {type(loaded).__name__}, "
                     "not the parameter blocks (dataset:, split:, training:, registry:)")
        unknown = set(loaded) - set(BLOCKS)
        if unknown:
            sys.exit(f"trainflow train: {args.config} has {sorted(unknown)}; a config holds "
                     f"only the blocks {', '.join(BLOCKS)}, as a deployment's parameters")
        base = merge_blocks(base, loaded, tuple(BLOCKS))
    return merge_blocks(base, given, tuple(BLOCKS))


def summary(result, seconds: float, stages: dict[str, float]) -> str:
    """What a person reads at the end of a run."""
    if result.skipped:
        return f"skipped: {result.skipped} (--force to train anyway)"
    t, e, r = result.trained, result.evaluation, result.registration
    counts = t.job.split.counts
    sizes = " / ".join(f"{s} {sum(counts[s].values())}" for s in ("train", "val", "test"))
    metrics = e.metrics
    lines = [
        f"data      {len(t.class_names)} classes; {sizes}",
        f"training  world size {t.world_size}, best epoch {t.best_epoch} of "
        f"{len(t.history)} (val accuracy {t.best_metrics.val_accuracy:.4f}, {t.how_chosen()})",
        f"test      accuracy {metrics['accuracy']:.4f}, macro F1 {metrics['macro_f1']:.4f} on "
        f"{e.images} images",
        f"registry  {r.model_name} {r.description()}",
    ]
    if result.review is not None:  # a file to open here, and its copy in the MLflow run
        lines.append(f"review    {result.review.folder / 'review.html'}")
    if result.mlflow_url:
        lines.append(f"mlflow    {result.mlflow_url}")
        uri = tracking_uri()
        if not uri.startswith(("http://", "https://")):  # no server answers that link yet
            lines.append(f"          (a local store: mlflow ui --backend-store-uri {redacted(uri)})")
    if result.prefect_url:
        lines.append(f"prefect   {result.prefect_url}")
    timing = ", ".join(f"{name} {s:.1f} s" for name, s in stages.items())
    lines.append(f"time      {seconds:.1f} s" + (f" ({timing})" if timing else ""))
    return "\n".join(lines)


def stage_seconds(flow_run_id) -> dict[str, float]:
    """Each task run's wall time, read back from Prefect."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    stages: dict[str, float] = {}
    for run in sorted(runs, key=lambda r: r.start_time or r.expected_start_time):
        if run.start_time and run.end_time:
            name = run.name.rsplit("-", 1)[0]
            stages[name] = stages.get(name, 0) + (run.end_time - run.start_time).total_seconds()
    return stages


def quiet_mlflow() -> None:
    """A person reads this output: the run's lines, one per epoch, and the summary. MLflow's
    INFO lines and its artifact progress bars (carriage-return redraws, two per registration)
    add nothing to them. Before MLflow is imported, which reads the level; a value set is kept.
    """
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def run_train(params: dict, as_json: bool, force: bool = False, from_file: bool = True) -> None:
    """train-flow on PREFECT_API_URL or the reused local server; bad values end it first.

    Values that came from a config file are checked here, merged with the flags, before a
    server starts; flags alone were checked when parsed (`from_file=False`). The flow then
    validates what it is given once, as it does for a deployment's run."""
    from commands.python_api import hand_started_prefect

    quiet_mlflow()
    if from_file:
        try:
            validate_blocks(params)
        except InvalidParameters as e:
            sys.exit("train-flow: invalid parameters\n"
                     + "\n".join(f"  {p}" for p in e.problems))
    started = time.perf_counter()
    from runtime.remote import RemoteRootError

    try:
        with hand_started_prefect():
            from flows.train_flow import train_flow

            state = train_flow(**params, force=force, return_state=True)
            result = state.result(raise_on_failure=False)
            stages = stage_seconds(state.state_details.flow_run_id)
    except RemoteRootError as e:  # the results block of a remote root could not be saved
        sys.exit(f"train-flow: {e}")
    if isinstance(result, BaseException):
        sys.exit(f"train-flow failed: {type(result).__name__}: {result}")
    if as_json:
        print(result.model_dump_json(indent=2))
        return

    print(summary(result, time.perf_counter() - started, stages))


def train(argv: list[str]) -> None:
    args, given = parse(TrainArgs, argv, "trainflow train")
    run_train(train_parameters(args, given), args.json_output, args.force,
              from_file=args.config is not None)


def run(argv: list[str]) -> None:
    args, given = parse(RunArgs, argv, "trainflow run")
    from prefect.deployments import run_deployment

    flow_run = run_deployment(args.deployment, parameters=given,
                              timeout=None if args.watch else 0)
    print(f"flow run {flow_run.name} ({flow_run.id}) of {args.deployment}: "
          f"{flow_run.state.name if flow_run.state else 'scheduled'}; fields set: "
          f"{json.dumps(given)}")
    if args.watch and flow_run.state and not flow_run.state.is_completed():
        sys.exit(1)


def sweep(argv: list[str]) -> None:
    args, given = parse(SweepArgs, argv, "trainflow sweep")
    from commands.local_server import local_prefect_api

    params = train_parameters(args, given)
    options = args.model_dump(mode="json", include={"n_trials", "max_concurrency", "budget_s",
                                                    "storage", "search_space"})
    quiet_mlflow()
    with local_prefect_api():
        from flows.sweep_flow import sweep_flow

        result = sweep_flow(**params, **options)
    if args.json_output:
        print(result.model_dump_json(indent=2, exclude={"sweep": {"best"}}))
        return
    s = result.sweep
    print(f"sweep     {s.study_name}: {json.dumps(s.trials)} trials; best "
          f"{json.dumps(s.best_params)} (val accuracy {s.best_value:.4f}); "
          f"{s.epochs_not_run} epochs saved by pruning")
    print(f"test      accuracy {result.evaluation.metrics['accuracy']:.4f}, macro F1 "
          f"{result.evaluation.metrics['macro_f1']:.4f} on {result.evaluation.images} images")
    print(f"registry  {result.registration.model_name} {result.registration.description()}")
