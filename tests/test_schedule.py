"""Learning-rate schedules from torch's own schedulers, and where a resumed run picks them up."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, OneCycleLR, SequentialLR

from training.config import TrainingSpec
from training.engine.schedule import EarlyStopping, continue_after, make_scheduler

SCHEDULES = [(name, warmup) for name in ("constant", "cosine", "onecycle", "step")
             for warmup in (0, 1)]


def _epoch_end_lrs(spec: TrainingSpec, steps: int, epochs: int, optimizer=None,
                   scheduler=None) -> list[float]:
    optimizer = optimizer or torch.optim.Adam(torch.nn.Linear(2, 2).parameters(), lr=spec.lr)
    scheduler = scheduler or make_scheduler(spec, optimizer, steps)
    lrs = []
    for _ in range(epochs):
        for _ in range(steps):
            optimizer.step()
            scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_the_schedules_are_torchs():
    optimizer = torch.optim.Adam(torch.nn.Linear(2, 2).parameters(), lr=0.01)
    assert isinstance(make_scheduler(TrainingSpec(), optimizer, 10), OneCycleLR)  # the default
    cosine = make_scheduler(TrainingSpec(lr_schedule="cosine"), optimizer, 10)
    assert isinstance(cosine, CosineAnnealingLR)
    warm = make_scheduler(TrainingSpec(lr_schedule="cosine", warmup_epochs=1), optimizer, 10)
    assert isinstance(warm, SequentialLR)


@pytest.mark.parametrize(("name", "warmup"), SCHEDULES)
def test_a_resume_with_another_step_count_continues_the_uninterrupted_curve(name, warmup):
    """Killed after 2 of 4 epochs at 10 steps an epoch (2 processes), resumed at 20 (1)."""
    spec = TrainingSpec(lr_schedule=name, warmup_epochs=warmup, epochs=4, lr=0.01)
    uninterrupted = _epoch_end_lrs(spec, 20, 4)
    first = torch.optim.Adam(torch.nn.Linear(2, 2).parameters(), lr=spec.lr)
    saved = make_scheduler(spec, first, 10)
    _epoch_end_lrs(spec, 10, 2, first, saved)

    optimizer = torch.optim.Adam(torch.nn.Linear(2, 2).parameters(), lr=spec.lr)
    resumed = make_scheduler(spec, optimizer, 20)
    resumed.load_state_dict(saved.state_dict())  # what Accelerate's load_state restores
    continue_after(resumed, lambda: make_scheduler(spec, optimizer, 20), 2, 20)
    assert resumed.last_epoch == 40
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        after = _epoch_end_lrs(spec, 20, 2, optimizer, resumed)
    assert after == pytest.approx(uninterrupted[2:], rel=1e-9, abs=1e-12)


def test_early_stopping_state_round_trips_through_a_checkpoint():
    stopper = EarlyStopping(patience=2, min_delta=0.0)
    stopper.should_stop(0.9)
    stopper.should_stop(0.8)
    again = EarlyStopping(patience=2, min_delta=0.0)
    again.load_state_dict(stopper.state_dict())
    assert again.should_stop(0.85) and again.stopped  # the count went on from 1
