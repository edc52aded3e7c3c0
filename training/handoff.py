"""The typed results the stages hand each other, so that no stage rediscovers files.

    prepare ──DatasetRef──> split ──SplitResult──> train ──TrainResult──> evaluate, register
                                        (TrainJob = SplitResult + TrainingSpec + output folder)

`TrainJob` is also the job file that `accelerate launch -m training.train --job JOB.json`
reads: it carries the split's summary, so the ranks read nothing else to know the data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from trainflow_serving.images import Geometry
from training.config import Spec, TrainingSpec
from training.engine.events import EpochMetrics


class AuditResult(BaseModel):
    """What the data audit found (training/data/audit.py), beside the split it shaped."""

    file: Path
    """audit.json: every finding, one object per image"""
    counts: dict[str, int]
    """audit_duplicate_groups, audit_leaks, audit_label_issues, audit_outliers,
    audit_quarantined: the run's metrics"""
    summary: str
    label_issue_share: float
    policy: dict
    """the `audit` block it ran with"""


class SplitResult(BaseModel):
    """The manifest and what every later stage needs to know about the data in it."""

    manifest: Path
    manifest_sha256: str
    counts: dict[str, dict[str, int]]
    """split -> class -> images"""
    quarantined: int
    class_names: list[str]
    channels: int
    """1 when every image is grayscale, else 3"""
    root: Path
    """The folder the manifest's paths are relative to."""
    given_splits: dict[str, str] | None = None
    """{folder: split} when the data came split and the splits were kept (split.respect_given)."""
    audit: AuditResult | None = None
    """None when `audit.enabled` is false."""
    decoded_only: bool = False
    """True on a machine that fetched the split from the remote root: the images are not here,
    and the decode stores hold a row for every file of the manifest."""

    def size(self, split: str) -> int:
        return sum(self.counts[split].values())


class Preprocessing(Spec):
    """How an image becomes the model's input: the same for training, evaluation and serving."""

    image_size: int
    channels: int
    mean: list[float]
    std: list[float]
    crop_from: int = 0
    """0: the whole image squashed to image_size; else its shorter side resized to this and
    the centre image_size square cut out (trainflow_serving.images.Geometry)."""
    resize: str = "bilinear, squashed to a square"
    scale: str = "1/255"

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.image_size, self.crop_from)


class JobFileError(ValueError):
    """A job file that is missing, or is not a training job."""


class TrainJob(Spec):
    """What one training launch does: the data (from the split stage), the spec, the folder."""

    split: SplitResult = Field(description="The split stage's result: manifest and summary.")
    training: TrainingSpec = TrainingSpec()
    output_dir: Path = Field(description="Checkpoints, weights and progress events go here.")
    metric: Literal["accuracy", "macro_f1", "balanced_accuracy", "roc_auc"] = Field(
        "accuracy", description="The test metric the gate compares (registry.metric): with "
        "training.choose_epoch auto, the epoch kept is the best on its val figure.")

    @property
    def manifest(self) -> Path:
        return self.split.manifest

    def save(self) -> Path:
        """The job file the ranks read, `output_dir/job.json`, written atomically."""
        from training.storage import write_text_atomic

        path = self.output_dir / "job.json"
        write_text_atomic(path, self.model_dump_json(indent=2))
        return path

    @classmethod
    def load(cls, path: Path) -> TrainJob:
        """A job file, or JobFileError naming the file and what is wrong with it. A
        hand-written job may name the split by its manifest instead of holding it."""
        try:
            data = json.loads(Path(path).read_text())
            if isinstance(data, dict) and "manifest" in data and "split" not in data:
                summary = Path(data.pop("manifest")).parent / "summary.json"
                data["split"] = SplitResult.model_validate_json(summary.read_text())
            return cls.model_validate(data)
        except FileNotFoundError as e:
            raise JobFileError(f"job file {path} or the split it names does not exist: {e}"
                               ) from None
        except ValueError as e:
            raise JobFileError(f"job file {path} is not a valid training job: {e}") from None


def job_for_ranks(path: Path) -> TrainJob:
    """The job an entry point was started with; a bad job file ends every rank with its one-line
    reason before any work, instead of a traceback per rank."""
    try:
        return TrainJob.load(path)
    except JobFileError as e:
        raise SystemExit(str(e)) from None


class TrainResult(BaseModel):
    """What a training launch produced, with everything needed to use its weights."""

    model_config = ConfigDict(frozen=True)

    job: TrainJob
    preprocessing: Preprocessing
    weights: Path
    best_epoch: int
    best_metrics: EpochMetrics
    history: list[EpochMetrics]
    world_size: int
    chosen_by: str = "val_accuracy"
    """How the kept epoch was chosen: a rule of training.engine.checkpoint.better."""

    def how_chosen(self) -> str:
        """The kept epoch's choice, as the log, the summary and the description say it."""
        if self.chosen_by == "last":
            return (f"the last: the val split's {self.job.split.size('val')} images are too few "
                    "to choose on (training.choose_min_val_images)")
        figure, ties, by = self.chosen_by.partition("~")
        within = f"; within the val split's noise, by {by.replace('_', ' ')}" if ties else ""
        return f"by {figure.replace('_', ' ')}{within}"
    mlflow_unsent: int = 0
    test_dir: Path | None = None
    """Set when the launch also predicted the test split with the best weights (its ranks were
    up already): logits.safetensors and predictions.csv are there for evaluate_model."""

    @property
    def output_dir(self) -> Path:
        return self.job.output_dir

    @property
    def class_names(self) -> list[str]:
        return self.job.split.class_names
