"""Stopping for a preemption notice without losing the epoch in progress.

A spot machine's notice, a Kubernetes eviction and torchrun passing on its own SIGTERM all reach
the ranks as SIGTERM, each at its own moment. Every `heartbeat_steps` optimizer steps the ranks
agree (one all-reduce of a flag) whether any of them was asked to stop; if so all of them stop
after that same step, save the Accelerate state there with where the epoch stood, and leave.
A retry resumes at the next batch of that epoch (`skip_first_batches`, the same sampler order).
"""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass, field

import torch
from accelerate import Accelerator


@dataclass
class EpochSoFar:
    """Where an interrupted epoch stood: batches done on each rank, the loss sum, correct count
    and images over every rank so far, its seconds so far, and the world that ran it."""

    batches: int
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    seconds: float = 0.0
    world_size: int = 1

    def as_dict(self) -> dict:
        return asdict(self)


class StopForPreemption(Exception):  # noqa: N818  (a stop asked for, not an error)
    def __init__(self, so_far: EpochSoFar):
        super().__init__(f"preempted after batch {so_far.batches}")
        self.so_far = so_far


class PreemptionNotice:
    """SIGTERM sets a flag; `agreed` tells every rank the same answer at the same step."""

    def __init__(self) -> None:
        self.asked = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.asked = True

    def agreed(self, accelerator: Accelerator) -> bool:
        flag = torch.tensor([1.0 if self.asked else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)
