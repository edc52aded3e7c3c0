"""Unbalanced classes: a balanced loss, a metric a rare class counts in, and a warning when the
gate would judge them on accuracy."""

from __future__ import annotations

import logging

import pytest
import torch

from tasks.evaluate import run_evaluation
from tasks.train import imbalance_warning, run_training
from tests.imagegen import write_folder_layout
from training.config import DatasetSpec, RegistrySpec, SplitSpec, TrainingSpec
from training.data.sources import prepare
from training.data.split import split_dataset
from training.evaluation.metrics import compute_metrics
from training.handoff import TrainJob
from training.train import loss_weights

LOG = logging.getLogger("unbalanced-test")


@pytest.fixture(scope="module")
def unbalanced(tmp_path_factory):
    """cat 300, dog 300, bird 20 real image files: the largest class 15x the smallest."""
    home = tmp_path_factory.mktemp("unbalanced")
    write_folder_layout(home / "photos", {"cat": 300, "dog": 300, "bird": 20})
    return split_dataset(prepare(DatasetSpec(source=str(home / "photos")), home), SplitSpec(),
                         home)


def test_balanced_class_weights_make_each_class_count_alike(unbalanced, tmp_path):
    job = TrainJob(split=unbalanced, output_dir=tmp_path, training={"class_weights": "balanced"})
    weights = loss_weights(job, torch.device("cpu"))
    counts = [unbalanced.counts["train"][name] for name in unbalanced.class_names]
    total = sum(counts)
    assert weights.tolist() == pytest.approx([total / (3 * n) for n in counts])
    # Each class's total weight in the loss is the same.
    assert [w * n for w, n in zip(weights.tolist(), counts, strict=True)] == pytest.approx(
        [total / 3] * 3)
    assert loss_weights(job.model_copy(update={"training": TrainingSpec()}),
                        torch.device("cpu")) is None


def test_balanced_accuracy_is_the_mean_recall_that_a_rare_class_counts_in():
    # 90 of class 0, 10 of class 1; a model that always answers 0 is 90% accurate.
    labels = torch.tensor([0] * 90 + [1] * 10)
    always_zero = torch.tensor([[5.0, 0.0]] * 100)
    figures = compute_metrics(always_zero, labels, ["common", "rare"])
    assert figures["accuracy"] == pytest.approx(0.9)
    assert figures["balanced_accuracy"] == pytest.approx(0.5)
    assert RegistrySpec(metric="balanced_accuracy").metric == "balanced_accuracy"


def test_the_run_warns_when_unbalanced_classes_are_judged_on_accuracy(unbalanced):
    warning = imbalance_warning(unbalanced, "accuracy")
    assert warning is not None and warning.startswith("unbalanced classes: ")
    assert "x the train images of 'bird'" in warning
    assert "set registry.metric to balanced_accuracy or macro_f1" in warning
    assert imbalance_warning(unbalanced, "balanced_accuracy") is None


def test_a_weighted_run_keeps_the_epoch_best_on_balanced_accuracy(unbalanced, tmp_path):
    """A real 2-process launch: the balanced loss, and the epoch chosen on the val figure of
    the gate's metric."""
    job = TrainJob(split=unbalanced, output_dir=tmp_path / "train", metric="balanced_accuracy",
                   training={"class_weights": "balanced", "epochs": 2, "image_size": 16,
                             "choose_min_val_images": 1})
    result = run_training(job, LOG, resume=False, evaluate_into=tmp_path / "evaluation")
    assert result.world_size == 2
    assert result.chosen_by == "val_balanced_accuracy~val_loss"
    assert all(0 <= h.val_balanced_accuracy <= 1 for h in result.history)
    params = [e for e in _events(job) if e.event == "params"][0].params
    assert params["class_weights"] == "balanced"
    # What the gate compares and MLflow logs as test_balanced_accuracy.
    evaluation = run_evaluation(result, tmp_path / "evaluation", LOG)
    recalls = [figures.recall for figures in evaluation.per_class.values()]
    assert evaluation.metrics["balanced_accuracy"] == pytest.approx(sum(recalls) / 3)


def _events(job: TrainJob):
    from training.engine.progress import ProgressReader

    return ProgressReader(job.output_dir).poll()
