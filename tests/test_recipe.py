"""The training recipe: schedules that resume, early stopping, accumulation, transfer learning."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from runtime.launcher import LaunchFailed
from tasks.train import run_training
from training.engine.progress import ProgressReader
from training.handoff import TrainJob
from training.models.build import head_of, load_trained, model_for, pretrained_weights_file

pytestmark = pytest.mark.slow
LOG = logging.getLogger("test-recipe")


def _job(digits_split, tmp_path, name, **training):
    _, split = digits_split
    spec = {"epochs": 3, "batch_size": 50, "image_size": 12, "num_processes": 2, **training}
    return TrainJob(split=split, output_dir=tmp_path / name, training=spec)


def _lrs(result) -> list[float]:
    return [h.learning_rate for h in result.history]


def test_a_resumed_run_continues_the_same_learning_rate_curve(digits_split, tmp_path,
                                                               monkeypatch):
    schedule = {"lr_schedule": "cosine", "warmup_epochs": 1, "epochs": 4}
    straight = run_training(_job(digits_split, tmp_path, "straight", **schedule), LOG)
    curve = _lrs(straight)
    assert curve[0] > curve[1] > curve[2] > curve[3] >= 0  # warm-up done, then cosine down

    job = _job(digits_split, tmp_path, "killed", **schedule)
    with pytest.raises(LaunchFailed):
        run_training(job, LOG, extra_env={"TRAINFLOW_FAULT": "kill:rank=1:epoch=3:step=2"})
    resumed = run_training(job, LOG, resume=True)
    events = ProgressReader(job.output_dir).poll()
    assert any(e.event == "resumed" and e.epoch == 2 for e in events)
    assert _lrs(resumed) == pytest.approx(curve, rel=1e-9)


@pytest.mark.extended
def test_a_resume_on_another_world_size_continues_the_same_curve(digits_split, tmp_path):
    """2 processes killed in epoch 3, resumed with 1 (a GPU gone): each epoch's learning rate is
    the uninterrupted 2-process run's, at the same number of samples seen."""
    schedule = {"lr_schedule": "cosine", "warmup_epochs": 1, "epochs": 4}
    curve = _lrs(run_training(_job(digits_split, tmp_path, "two", **schedule), LOG))
    job = _job(digits_split, tmp_path, "shrunk", **schedule)
    with pytest.raises(LaunchFailed):
        run_training(job, LOG, extra_env={"TRAINFLOW_FAULT": "kill:rank=1:epoch=3:step=2"})
    one = job.model_copy(update={"training": job.training.model_copy(
        update={"num_processes": 1})})
    resumed = run_training(one, LOG, resume=True)
    assert resumed.world_size == 1
    assert any(e.event == "resumed" and e.epoch == 2
               for e in ProgressReader(job.output_dir).poll())
    assert _lrs(resumed) == pytest.approx(curve, rel=1e-9)


def test_early_stopping_stops_every_rank_and_keeps_the_best_epoch(digits_split, tmp_path):
    # No epoch can gain 0.5 in accuracy over the first: training stops after epoch 2.
    job = _job(digits_split, tmp_path, "early", epochs=8, early_stopping_patience=1,
               early_stopping_min_delta=0.5)
    result = run_training(job, LOG)
    assert [h.epoch for h in result.history] == [1, 2]
    events = ProgressReader(job.output_dir).poll()
    assert sorted(e.rank for e in events if e.event == "early_stop") == [0, 1]
    first, second = result.history
    # The gate's metric beyond one binomial standard error of the val split; within it, loss.
    n = first.val_images
    noise = max((first.val_accuracy * (1 - first.val_accuracy) / n) ** 0.5, 1 / n)
    if abs(second.val_accuracy - first.val_accuracy) > noise:
        expected = 2 if second.val_accuracy > first.val_accuracy else 1
    else:
        expected = 2 if second.val_loss < first.val_loss else 1
    assert result.chosen_by == "val_accuracy~val_loss" and result.best_epoch == expected
    with safe_open(str(result.weights), "pt") as f:
        assert f.metadata()["epoch"] == str(result.best_epoch)


def test_accumulation_gives_the_same_effective_batch(digits_split, tmp_path):
    """Two batches of 25 per optimizer step make the steps of one batch of 50."""
    schedule = {"lr_schedule": "cosine", "epochs": 3, "num_processes": 1}
    half = run_training(_job(digits_split, tmp_path, "half", batch_size=25,
                             gradient_accumulation_steps=2, **schedule), LOG)
    whole = run_training(_job(digits_split, tmp_path, "whole", batch_size=50, **schedule), LOG)
    small = run_training(_job(digits_split, tmp_path, "small", batch_size=25, **schedule), LOG)
    steps = {name: [h.optimizer_steps for h in r.history]
             for name, r in (("half", half), ("whole", whole), ("small", small))}
    batches = -(-sum(digits_split[1].counts["train"].values()) // 50)  # per epoch
    assert steps["half"] == steps["whole"] == [batches, 2 * batches, 3 * batches]
    assert steps["small"] == [2 * s for s in steps["whole"]]  # without accumulation
    assert _lrs(half) == pytest.approx(_lrs(whole))
    assert half.best_metrics.val_accuracy > 0.5


def test_a_frozen_pretrained_backbone_stays_bit_identical_and_the_head_trains(
        digits_split, tmp_path, monkeypatch):
    # No download here: a checkpoint made locally, where torchvision looks for resnet18's.
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    import torchvision

    checkpoint = torchvision.models.resnet18(num_classes=1000).state_dict()
    path = pretrained_weights_file("resnet18")
    path.parent.mkdir(parents=True)
    torch.save(checkpoint, path)
    job = _job(digits_split, tmp_path, "frozen", model="resnet18", pretrained=True,
               freeze_backbone=True, epochs=2, image_size=32, optimizer="sgd", lr=0.01,
               augment="none")  # digits: a fine-tune's flips and crops are for photos
    result = run_training(job, LOG)
    trained = load_file(result.weights)
    head = {f"fc.{k}" for k in head_of(model_for(job, pretrained=False)).state_dict()}
    backbone = [k for k in trained if k not in head]
    assert len(backbone) > 100
    for key in backbone:  # weights and BatchNorm statistics alike
        assert torch.equal(trained[key], checkpoint[key]), key
    torch.manual_seed(job.training.seed)  # the head as training initialised it
    initial = model_for(job).state_dict()
    assert trained["fc.weight"].shape == (10, 512)
    assert not torch.equal(trained["fc.weight"], initial["fc.weight"])
    assert result.best_metrics.val_accuracy > 0.2  # chance is 0.1


def test_the_other_recipe_switches_train(digits_split, tmp_path):
    job = _job(digits_split, tmp_path, "switches", epochs=2, label_smoothing=0.1,
               channels_last=False, augment="trivialaugment", lr_schedule="onecycle", loader_workers=1,
               mixed_precision="bf16", optimizer="adamw", backbone_lr_factor=0.5)
    result = run_training(job, LOG)
    assert result.world_size == 2 and result.best_metrics.val_accuracy > 0.3


def test_compiled_ddp_training_saves_plain_weights(digits_split, tmp_path):
    """Two processes with compile: DDP wraps the original module (compiled after prepare), so
    the best weights are plain and load strictly at the end (before, the run failed there)."""
    job = _job(digits_split, tmp_path, "compiled", epochs=2, compile=True, num_processes=2)
    result = run_training(job, LOG)
    assert result.world_size == 2
    assert not any(k.startswith("_orig_mod.") for k in load_file(result.weights))
    load_trained(job, result.weights)  # strict
