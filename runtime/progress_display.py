"""How far long work has got, shown where a person looks: a bar with the rate and the time left
on a terminal, otherwise a log line every 30 s (which the Prefect UI shows with the run's logs).

The figures come from the ranks' heartbeat events (training/engine/events.py): no channel of
its own. The train task also turns them into its Prefect progress artifact (`on_fraction`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from training.engine.events import EpochEnded, Event, Heartbeat, Started

LOG_EVERY_S = 30.0
FRACTION_EVERY_S = 5.0
COUNTED_IN_IMAGES = ("decode", "score")
"""Phases whose heartbeats count images, not batches."""


@dataclass
class _Phase:
    name: str
    total: int
    first_step: int
    first_time: float
    done: int = 0
    rate: float | None = None
    """Steps per second since the phase's first report."""


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


class PhaseProgress:
    """One phase at a time (decoding, an epoch's training, validation, evaluation, scoring):
    `update(name, done, total)`; a new name starts a new bar."""

    def __init__(self, logger, every_s: float | None = None, unit: str = "steps",
                 terminal: bool | None = None):
        self.logger, self.unit = logger, unit
        self.every_s = LOG_EVERY_S if every_s is None else every_s
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self._phase: _Phase | None = None
        self._last_log = time.monotonic()
        self._bar = self._task = None
        self.images_per_step: float | None = None

    def update(self, name: str, done: int, total: int, at: float | None = None) -> None:
        at = time.time() if at is None else at
        phase = self._phase
        if phase is None or phase.name != name or done < phase.done:
            phase = self._phase = _Phase(name, total, done, at)
            self._new_bar(name, total)
        phase.done, phase.total = done, total
        if at > phase.first_time and done > phase.first_step:
            phase.rate = (done - phase.first_step) / (at - phase.first_time)
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total, rate=self._rate_text())
        elif time.monotonic() - self._last_log >= self.every_s:
            self._last_log = time.monotonic()
            self.logger.info("%s", self.line())

    def line(self) -> str:
        """Where the phase is: "epoch 2/8 train: 120 of 450 steps (27%), 85 images/s, about
        2 min 10 s left"."""
        phase = self._phase
        if phase is None:
            return "starting"
        share = f" ({100 * phase.done / phase.total:.0f}%)" if phase.total else ""
        text = f"{phase.name}: {phase.done} of {phase.total} {self.unit}{share}"
        if phase.rate:
            text += f", {self._rate_text()}, about {_duration(self.seconds_left())} left"
        return text

    def seconds_left(self) -> float:
        phase = self._phase
        if phase is None or not phase.rate:
            return float("nan")
        return max(0, phase.total - phase.done) / phase.rate

    def fraction(self) -> float:
        phase = self._phase
        return phase.done / phase.total if phase and phase.total else 0.0

    def _rate_text(self) -> str:
        rate = self._phase.rate if self._phase else None
        if not rate:
            return ""
        if self.images_per_step:
            return f"{rate * self.images_per_step:.0f} images/s"
        return f"{rate:.1f} {self.unit}/s"

    def _new_bar(self, name: str, total: int) -> None:
        if not self.terminal:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.close()
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                             MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                             TimeRemainingColumn(), transient=True)
        self._bar.start()
        self._task = self._bar.add_task(name, total=total, rate="")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = self._task = None


class LaunchProgress:
    """The ranks' heartbeats as a PhaseProgress, from rank 0's (every rank moves in step):
    training steps with images/s, validation, evaluation and scoring. `on_fraction(share)`
    hears how much of the whole training is done, with each epoch's steps."""

    def __init__(self, logger, epochs: int | None = None,
                 on_fraction: Callable[[float], None] = lambda share: None,
                 terminal: bool | None = None, every_s: float | None = None):
        self.display = PhaseProgress(logger, every_s=every_s, terminal=terminal)
        self.epochs, self.on_fraction = epochs, on_fraction
        self.world = 1
        self._told = 0.0

    def on_event(self, event: Event) -> None:
        if isinstance(event, Started):
            self.world = event.world_size
        elif isinstance(event, Heartbeat) and event.rank == 0 and event.total:
            # Steps of a batch on every rank, or (decoding, scoring) images counted directly.
            counted = event.phase.startswith(COUNTED_IN_IMAGES)
            self.display.unit = "images" if counted else "steps"
            self.display.images_per_step = (event.images * self.world if event.images
                                            else None)
            name = (f"epoch {event.epoch}/{self.epochs} {event.phase}"
                    if event.epoch is not None and self.epochs else event.phase)
            self.display.update(name, event.step or 0, event.total, at=event.time)
            # Within an epoch at most every FRACTION_EVERY_S: each is a call to the server.
            if (event.phase == "train" and self.epochs and event.epoch
                    and time.monotonic() - self._told >= FRACTION_EVERY_S):
                self._told = time.monotonic()
                self.on_fraction((event.epoch - 1 + self.display.fraction()) / self.epochs)
        elif isinstance(event, EpochEnded) and event.rank == 0:
            self.display.close()  # the epoch's own line follows
            self.on_fraction(event.epoch / event.epochs)

    def close(self) -> None:
        self.display.close()
