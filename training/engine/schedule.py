"""The recipe around the loop: optimizer with parameter groups, learning-rate schedule, early stop.

The scheduler steps once per optimizer step (not per batch: with gradient accumulation those
differ) and is registered with Accelerate, so `save_state`/`load_state` carry its position and
a resumed run continues the same curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from training.config import TrainingSpec
from training.models.build import head_of

WARMUP_START = 0.1  # warm-up begins at 10% of lr, so the first steps already learn
ONECYCLE_WARMUP = 0.3  # onecycle's rise when warmup_epochs is not given (torch's pct_start)


def make_optimizer(spec: TrainingSpec, model: nn.Module) -> torch.optim.Optimizer:
    """Adam, AdamW or SGD (momentum 0.9); the backbone at lr x backbone_lr_factor, or frozen."""
    head = {id(p) for p in head_of(model).parameters()}
    backbone = [p for p in model.parameters() if id(p) not in head]
    if spec.freeze_backbone:
        for p in backbone:
            p.requires_grad_(False)
    groups = [{"params": [p for p in model.parameters() if id(p) in head], "lr": spec.lr}]
    if not spec.freeze_backbone:
        groups.append({"params": backbone, "lr": spec.lr * spec.backbone_lr_factor})
    groups = [g for g in groups if g["params"]]
    if spec.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=0.9, weight_decay=spec.weight_decay)
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.Adam(groups, lr=spec.lr, weight_decay=spec.weight_decay)


def lr_factor(spec: TrainingSpec, step: int, total: int, per_epoch: int) -> float:
    """The multiplier of each group's base learning rate at optimizer step `step` of `total`."""
    warmup = round(spec.warmup_epochs * per_epoch)
    if spec.lr_schedule == "onecycle" and not warmup:
        warmup = round(ONECYCLE_WARMUP * total)
    if step < warmup:
        return WARMUP_START + (1 - WARMUP_START) * step / warmup
    progress = (step - warmup) / max(1, total - warmup)
    if spec.lr_schedule in ("cosine", "onecycle"):
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    if spec.lr_schedule == "step":
        return 0.1 ** min(2, int(progress * 3))
    return 1.0


def make_scheduler(spec: TrainingSpec, optimizer: torch.optim.Optimizer,
                   steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    total = steps_per_epoch * spec.epochs
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(spec, step, total, steps_per_epoch))


def continue_after(scheduler: torch.optim.lr_scheduler.LRScheduler, epochs_done: int,
                   steps_per_epoch: int) -> None:
    """Put a resumed schedule where `epochs_done` whole epochs of *this* run's steps end.

    The saved state counts optimizer steps of the run that saved it; on another world size an
    epoch has another number of steps, and the old count would put the curve in the wrong place
    (with more processes, cosine reached 0 early and stayed there). Checkpoints are taken at
    epoch ends, so counting in epochs continues the uninterrupted run's curve exactly.
    """
    import warnings

    scheduler.last_epoch = epochs_done * steps_per_epoch - 1
    with warnings.catch_warnings():  # "step() before optimizer.step()": deliberate here
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()


@dataclass
class EarlyStopping:
    """Counts epochs without a validation accuracy gain; every rank sees the same gathered
    metrics, so every rank decides the same and they stop together."""

    patience: int | None
    min_delta: float
    best: float | None = None
    waited: int = 0
    stopped: bool = False

    def should_stop(self, val_accuracy: float) -> bool:
        if self.best is None or val_accuracy > self.best + self.min_delta:
            self.best, self.waited = val_accuracy, 0
            return False
        self.waited += 1
        self.stopped = self.patience is not None and self.waited >= self.patience
        return self.stopped
