"""The recipe around the loop: optimizer with parameter groups, learning-rate schedule, early stop.

The schedules are torch's own, stepped once per optimizer step (not per batch: with gradient
accumulation those differ). The scheduler and the early-stopping counter are registered with
Accelerate, so `save_state`/`load_state` carry them and a resumed run goes on where it was.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.lr_scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    MultiStepLR,
    OneCycleLR,
    SequentialLR,
)

from training.config import TrainingSpec
from training.models.build import head_of

WARMUP_START = 0.1  # warm-up begins at 10% of lr, so the first steps already learn
ONECYCLE_RISE = 0.3  # onecycle's rise when warmup_epochs is not given (torch's pct_start)


def make_optimizer(spec: TrainingSpec, model: nn.Module) -> torch.optim.Optimizer:
    """Adam, AdamW or SGD (momentum 0.9); the head (group 0) at lr, the backbone (group 1) at
    lr x backbone_lr_factor, or frozen."""
    head = {id(p) for p in head_of(model, spec.head).parameters()}
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


def backbone_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters make_optimizer put in the backbone's group (none when it is frozen)."""
    return list(optimizer.param_groups[1]["params"]) if len(optimizer.param_groups) > 1 else []


def make_scheduler(spec: TrainingSpec, optimizer: torch.optim.Optimizer,
                   steps_per_epoch: int) -> LRScheduler:
    """torch's schedulers, stepped once per optimizer step: onecycle is `OneCycleLR` (its rise
    over warmup_epochs, else 30% of the steps); the others are a `LinearLR` warm-up from 10% of
    lr (when warmup_epochs is given) followed, through `SequentialLR`, by `ConstantLR`,
    `CosineAnnealingLR` (down to 0 at the end) or `MultiStepLR` (x0.1 after each third)."""
    total = steps_per_epoch * spec.epochs
    warmup = min(round(spec.warmup_epochs * steps_per_epoch), total - 1)
    if spec.lr_schedule == "onecycle":
        # A schedule made again on the same optimizer (continue_after) finds the peak where
        # the first one left it: "lr" has moved since.
        return OneCycleLR(optimizer, max_lr=[g.get("max_lr", g["lr"]) for g in
                                             optimizer.param_groups],
                          total_steps=total, pct_start=warmup / total if warmup else ONECYCLE_RISE,
                          div_factor=1 / WARMUP_START, final_div_factor=1e4)
    rest = total - warmup
    if spec.lr_schedule == "cosine":
        after = CosineAnnealingLR(optimizer, T_max=max(1, rest), eta_min=0.0)
    elif spec.lr_schedule == "step":
        third = max(1, rest // 3)
        after = MultiStepLR(optimizer, milestones=[third, 2 * third], gamma=0.1)
    else:
        after = ConstantLR(optimizer, factor=1.0, total_iters=0)
    if not warmup:
        return after
    rise = LinearLR(optimizer, start_factor=WARMUP_START, end_factor=1.0, total_iters=warmup)
    return SequentialLR(optimizer, [rise, after], milestones=[warmup])


def continue_after(scheduler: LRScheduler, fresh: Callable[[], LRScheduler], epochs_done: int,
                   steps_per_epoch: int) -> None:
    """Put a resumed schedule where `epochs_done` whole epochs of *this* run's steps end.

    The state Accelerate restored counts optimizer steps of the run that saved it; on another
    world size an epoch has another number of steps, and that count would put the curve in the
    wrong place (with more processes, cosine reached 0 early and stayed there). Checkpoints are
    taken at epoch ends, so a schedule made afresh and stepped through that many epochs of this
    run's steps is exactly where the uninterrupted run's curve is.
    """
    target = epochs_done * steps_per_epoch
    if scheduler.last_epoch == target:
        return  # the same world size: the restored state is already there
    replay = fresh()
    with warnings.catch_warnings():  # "step() before optimizer.step()": deliberate here
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(target):
            replay.step()
    scheduler.load_state_dict(replay.state_dict())


@dataclass
class EarlyStopping:
    """Counts epochs without a validation accuracy gain; every rank sees the same gathered
    metrics, so every rank decides the same and they stop together. Registered with Accelerate
    (state_dict/load_state_dict), so a resumed run keeps counting, and a stopped one stays
    stopped."""

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

    def state_dict(self) -> dict:
        return {"best": self.best, "waited": self.waited, "stopped": self.stopped}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.waited, self.stopped = state["best"], state["waited"], state["stopped"]
