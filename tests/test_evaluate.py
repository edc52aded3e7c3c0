"""Evaluation: metrics on a hand-checked case, and the same numbers from 1 and 2 processes and
from the training launch itself."""

import json
import subprocess

import pytest
import torch

from runtime.launcher import launch_command, launch_env
from training.evaluation.metrics import compute_metrics
from training.handoff import TrainJob


def test_metrics_on_a_hand_checked_case():
    # 5 images, 2 classes. Predictions: [0, 1, 1, 0, 1]; truth: [0, 0, 1, 1, 1].
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [0.0, 3.0], [1.0, 0.0], [0.0, 2.0]])
    labels = torch.tensor([0, 0, 1, 1, 1])
    m = compute_metrics(logits, labels, ["cat", "dog"])
    assert m["images"] == 5
    assert m["accuracy"] == pytest.approx(3 / 5)
    assert m["confusion_matrix"] == [[1, 1], [1, 2]]
    # cat: precision 1/2, recall 1/2 -> f1 1/2; dog: precision 2/3, recall 2/3 -> f1 2/3
    assert m["per_class"]["cat"]["f1"] == pytest.approx(0.5)
    assert m["per_class"]["dog"]["precision"] == pytest.approx(2 / 3)
    assert m["macro_f1"] == pytest.approx((0.5 + 2 / 3) / 2)
    # dog-vs-cat logit margins: cats -2, 1; dogs 3, -1, 2. Of the 6 (dog, cat) pairs the dog
    # scores higher in 5 (all but -1 < 1).
    assert m["roc_auc"] == pytest.approx(5 / 6)
    expected_loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert m["loss"] == pytest.approx(expected_loss)


@pytest.mark.slow
def test_one_and_two_processes_give_identical_metrics(digits_split, tmp_path):
    import logging

    from tasks.evaluate import run_evaluation
    from tasks.train import run_training

    _, split = digits_split
    job = TrainJob(split=split, output_dir=tmp_path / "train",
                   training={"epochs": 1, "image_size": 12, "num_processes": 2, "batch_size": 32,
                             "mixed_precision": "bf16"})
    # The training launch evaluates too (as train_model asks it): same numbers as alone.
    trained = run_training(job, logging.getLogger("t"), evaluate_into=tmp_path / "in-launch")
    # The flow's one evaluation path, over the predictions the training's ranks made.
    evaluation = run_evaluation(trained, tmp_path / "in-launch", logging.getLogger("t"))
    results = {}
    for n in (1, 2):
        spec = job.training.model_copy(update={"num_processes": n})
        command = launch_command(spec, "training.evaluate",
                                 ["--job", str(tmp_path / "train" / "job.json"),
                                  "--weights", str(trained.weights), "--out", str(tmp_path / f"e{n}")])
        done = subprocess.run(command, env=launch_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        results[n] = json.loads((tmp_path / f"e{n}" / "metrics.json").read_text())
    test_size = sum(split.counts["test"].values())
    assert results[1]["images"] == results[2]["images"] == test_size
    # Counts and labels exactly; floats within a tolerance: 1 process computes with 2 threads
    # and each of 2 ranks with 1, so float reductions may differ in the last digits.
    assert results[1]["confusion_matrix"] == results[2]["confusion_matrix"]
    assert results[1]["accuracy"] == results[2]["accuracy"]
    assert results[1]["loss"] == pytest.approx(results[2]["loss"], rel=1e-5)
    in_launch = json.loads((tmp_path / "in-launch" / "metrics.json").read_text())
    assert in_launch["confusion_matrix"] == results[2]["confusion_matrix"]
    assert evaluation.metrics["accuracy"] == results[2]["accuracy"]  # fp32, bf16 training
    assert evaluation.metrics["loss"] == pytest.approx(results[2]["loss"], rel=1e-5)
    # Without the training's predictions, the same path launches its own ranks to predict.
    alone = run_evaluation(trained.model_copy(update={"test_dir": None}), tmp_path / "alone",
                           logging.getLogger("t"))
    assert alone.metrics["accuracy"] == evaluation.metrics["accuracy"]
    assert json.loads((tmp_path / "alone" / "metrics.json").read_text())["confusion_matrix"] == (
        in_launch["confusion_matrix"])
    one, two = (_rows(tmp_path / f"e{n}" / "predictions.csv") for n in (1, 2))
    assert [r[:3] + r[4:] for r in one] == [r[:3] + r[4:] for r in two]  # path ... correct
    assert [float(r[3]) for r in one] == pytest.approx([float(r[3]) for r in two], abs=1e-4)


def _rows(path):
    import csv

    with open(path, newline="") as f:
        return list(csv.reader(f))[1:]
