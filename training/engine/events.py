"""The messages the ranks send whoever launched them: one typed model per kind.

Each rank writes them as JSON lines (training/engine/progress.py); the launching task reads them
back as these same models. A field misspelt on either side fails where it is written or read,
with the model's name, instead of as a missing key in another process.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class Event(BaseModel):
    """What every message carries: which rank sent it, and when (seconds since the epoch)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rank: int
    time: float


class Payload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EpochMetrics(Payload):
    """One epoch's figures, gathered over every rank: the same numbers on each."""

    epoch: int
    train_loss: float
    train_accuracy: float
    """Over the padded shards: a few images may count twice (validation is exact)."""
    val_loss: float
    val_accuracy: float
    val_images: int
    val_macro_f1: float | None = None
    val_balanced_accuracy: float | None = None
    val_roc_auc: float | None = None
    """The val figure of the metric the gate compares, when it is not accuracy."""
    epoch_seconds: float
    images_per_second: float
    learning_rate: float
    optimizer_steps: int

    def figures(self) -> dict[str, float]:
        """What is logged for the epoch (MLflow metrics, the log line): all but its number."""
        return self.model_dump(exclude={"epoch"}, exclude_none=True)


class ClassFigures(Payload):
    precision: float
    recall: float
    f1: float
    support: int
    """test images of this class"""


class TestMetrics(Payload):
    """The best weights on the test split, each image counted once."""

    accuracy: float
    loss: float
    macro_f1: float
    balanced_accuracy: float | None = None
    """the mean of the classes' recalls"""
    roc_auc: float | None = None
    """two classes only"""
    images: int
    per_class: dict[str, ClassFigures]

    def scores(self) -> dict[str, float]:
        """The metrics a gate can compare and MLflow logs as test_<name>."""
        return {k: v for k, v in self.model_dump(include={
            "accuracy", "loss", "macro_f1", "balanced_accuracy", "roc_auc"}).items()
            if v is not None}


class Started(Event):
    """The rank is up: the launcher's start-up watch ends, the hang watch begins."""

    event: Literal["start"] = "start"
    world_size: int
    device: str
    pid: int
    threads: int
    address: str | None = None
    """The address its machine joined the rendezvous with (several machines)."""


class Heartbeat(Event):
    """Progress within a phase (decode, train, val, evaluate, score), every few steps."""

    event: Literal["heartbeat"] = "heartbeat"
    phase: str
    epoch: int | None = None
    step: int | None = None
    total: int | None = None
    """Steps in the phase on this rank, where known."""
    images: int | None = None
    """Images in each of this rank's steps (the batch), where they are images."""


class Params(Event):
    """The run's effective parameters (rank 0), for the tracking run."""

    event: Literal["params"] = "params"
    params: dict[str, Any]


class EpochEnded(Event):
    """An epoch's gathered metrics; every rank sends the same numbers."""

    event: Literal["epoch"] = "epoch"
    epoch: int
    epochs: int
    metrics: EpochMetrics
    is_best: bool
    checkpoint: str
    world_size: int


class Preempted(Event):
    """The ranks stopped for a preemption notice (SIGTERM) after `batches` batches of `epoch`,
    with the state saved there: a retry resumes at the next batch."""

    event: Literal["preempted"] = "preempted"
    epoch: int
    batches: int
    checkpoint: str
    optimizer_steps: int


class Resumed(Event):
    event: Literal["resumed"] = "resumed"
    checkpoint: str
    epoch: int
    """Epochs already done."""
    batches: int = 0
    """Batches of the next epoch already done (a preempted epoch)."""


class EarlyStopped(Event):
    event: Literal["early_stop"] = "early_stop"
    epoch: int
    best_epoch: int


class Trained(Event):
    """Training finished: the best epoch's weights are saved and load."""

    event: Literal["trained"] = "trained"
    world_size: int
    best: EpochMetrics
    history: list[EpochMetrics]
    weights: str
    preprocessing: dict[str, Any]
    chosen_by: str = "val_accuracy"
    """How `best` was chosen: "val_loss", "val_accuracy" or "last" (too few val images)."""


class Evaluated(Event):
    """Test-split metrics (without the confusion matrix) and the folder of the full files."""

    event: Literal["evaluated"] = "evaluated"
    metrics: TestMetrics
    world_size: int
    out: str


class Predicted(Event):
    """The best weights' test-split logits and predictions.csv are in `out`
    (training.evaluate.predict_into); the metrics are computed from them by the reader
    (training.evaluate.write_results)."""

    event: Literal["predicted"] = "predicted"
    images: int
    world_size: int
    out: str


class ScoringFinished(Event):
    """Batch scoring finished; `scored` is None on ranks that wrote no predictions."""

    event: Literal["scored"] = "scored"
    world_size: int
    scored: dict[str, Any] | None


class Failed(Event):
    """The rank raised: its error in one line, and its traceback."""

    event: Literal["error"] = "error"
    error: str
    traceback: str


AnyEvent = Annotated[Started | Heartbeat | Params | EpochEnded | Preempted | Resumed | EarlyStopped
                     | Trained | Evaluated | Predicted | ScoringFinished
                     | Failed, Field(discriminator="event")]
_READ = TypeAdapter(AnyEvent)


def parse_event(line: str) -> Event:
    """One JSON line back into its model."""
    return _READ.validate_json(line)


E = TypeVar("E", bound=Event)


def last_from_rank_0(events: list[Event], kind: type[E]) -> E | None:
    """The newest message of `kind` from rank 0 (the one that reports results), if any."""
    found = [e for e in events if isinstance(e, kind) and e.rank == 0]
    return found[-1] if found else None
