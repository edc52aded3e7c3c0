"""The checkpoint policy: every epoch's Accelerate state, the best weights, and what to resume.

Naming and rotation are Accelerate's (`ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=...)`): `checkpoints/checkpoint_<epoch>/`. What Accelerate does not give is
completeness, so `trainer_state.json` is written last into each folder, atomically: a folder
without it was cut off mid-save and is never resumed from.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from safetensors.torch import save_model
from torch import nn

from training.engine.checkpoint_files import KEEP_CHECKPOINTS, STATE_FILE, checkpoint_number
from training.engine.preemption import EpochSoFar
from training.engine.progress import Rank
from training.handoff import TrainJob
from training.storage import atomic_path, write_json_atomic


def project_configuration(output_dir: Path) -> ProjectConfiguration:
    quiet_rotation()
    return ProjectConfiguration(project_dir=str(output_dir), automatic_checkpoint_naming=True,
                                total_limit=KEEP_CHECKPOINTS)


def quiet_rotation() -> None:
    """Drop Accelerate's warning that it deletes the oldest checkpoint: with total_limit that is
    the policy working, and it printed between the epoch lines of every run of 3+ epochs."""
    logger = logging.getLogger("accelerate.accelerator")
    if not any(isinstance(f, _RotationFilter) for f in logger.filters):
        logger.addFilter(_RotationFilter())


class _RotationFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "checkpoints to make room for new checkpoint" not in record.getMessage()


@dataclass
class TrainerState:
    """What the loop knows besides the tensors: saved with each checkpoint."""

    epoch: int = 0
    """Epochs done."""
    best: dict | None = None
    history: list[dict] = field(default_factory=list)
    interrupted: dict | None = None
    """The next epoch's part done before a preemption (training.engine.preemption.EpochSoFar)."""
    chosen_by: str = "val_accuracy"
    """How the kept epoch is chosen: a rule of `better`."""

    def record(self, epoch: int, metrics: dict) -> bool:
        """Add an epoch's metrics; True when it is the one to keep so far."""
        self.epoch, self.interrupted = epoch, None
        self.history.append({"epoch": epoch, **metrics})
        if self.best is None or better(metrics, self.best, self.chosen_by):
            self.best = {"epoch": epoch, **metrics}
            return True
        return False


TIES_BY = "~"
"""In a rule "val_<figure>~val_loss": the figure decides, and where two epochs' figures differ
by no more than the val split's binomial noise, the lower val loss does."""


def better(metrics: dict, best: dict, by: str = "val_accuracy") -> bool:
    """By "val_loss": lower loss wins. By "val_accuracy": higher accuracy, on a tie lower loss.
    By "val_<figure>~val_loss": a higher figure beyond the noise of the val split, within it
    the lower loss (`noise`). By "last": the newer epoch."""
    if by == "last":
        return True
    if TIES_BY in by:
        figure = by.partition(TIES_BY)[0]
        gain = metrics[figure] - best[figure]
        if abs(gain) > noise(best[figure], metrics["val_images"]):
            return gain > 0
        return metrics["val_loss"] < best["val_loss"]
    if by != "val_loss" and metrics[by] != best[by]:
        return metrics[by] > best[by]
    return metrics["val_loss"] < best["val_loss"]


def noise(share: float, images: int) -> float:
    """One binomial standard error of a share measured on `images` images, at least one image:
    the difference two epochs' val figures can show by the luck of the split alone."""
    return max(math.sqrt(max(share * (1 - share), 0.0) / max(images, 1)), 1 / max(images, 1))


class Checkpointer:
    def __init__(self, accelerator: Accelerator, rank: Rank, job: TrainJob, model: nn.Module):
        self.accelerator, self.rank, self.job, self.model = accelerator, rank, job, model
        self.folder = job.output_dir / "checkpoints"
        self.best_weights = job.output_dir / "best.safetensors"

    def save(self, epoch: int, state: TrainerState, is_best: bool) -> Path:
        if is_best and self.rank.main:
            # Unwrapped: no "module." (DDP) or "_orig_mod." (compile) prefixes in the names.
            with atomic_path(self.best_weights) as tmp:
                save_model(self.accelerator.unwrap_model(self.model, keep_torch_compile=False), str(tmp),
                           metadata={"epoch": str(epoch)})
            write_json_atomic(self.job.output_dir / "best.json", state.best)
        return self._save_state(epoch, state)

    def save_interrupted(self, state: TrainerState, so_far: EpochSoFar) -> Path:
        """The state mid-epoch, for a preemption: in the folder of the epoch in progress, which
        that epoch's end replaces once a retry finishes it."""
        state.interrupted = so_far.as_dict()
        return self._save_state(state.epoch + 1, state)

    def _save_state(self, number: int, state: TrainerState) -> Path:
        folder = self.folder / f"checkpoint_{number}"
        superseded = folder.exists()  # this epoch's interrupted state
        self.accelerator.wait_for_everyone()  # every rank looked before any removes it
        if superseded:
            if self.rank.main:
                shutil.rmtree(folder)
            self.accelerator.wait_for_everyone()
        self.accelerator.project_configuration.iteration = number
        self.accelerator.save_state()
        if self.rank.main:
            write_json_atomic(folder / "job.json", json.loads(self.job.model_dump_json()))
            write_json_atomic(folder / STATE_FILE, asdict(state))  # last: marks it complete
        self.accelerator.wait_for_everyone()
        return folder

    def latest(self) -> Path | None:
        """The newest complete checkpoint that this world can resume from."""
        done = sorted((p.parent for p in self.folder.glob(f"checkpoint_*/{STATE_FILE}")),
                      key=lambda folder: checkpoint_number(folder.name), reverse=True)
        for folder in done:
            interrupted = json.loads((folder / STATE_FILE).read_text()).get("interrupted")
            # An epoch's batches do not map onto another world's shards: from such a stop,
            # the epoch before is resumed instead, and the interrupted epoch is run whole.
            if not interrupted or interrupted["world_size"] == self.rank.world:
                return folder
        return None

    def resume(self) -> TrainerState | None:
        """Load the newest complete checkpoint into the prepared objects; None if there is none."""
        latest = self.latest()
        if latest is None:
            return None
        if self.rank.main:  # a save cut off after it would block Accelerate's naming
            for stale in self.folder.glob("checkpoint_*"):
                if checkpoint_number(stale.name) > checkpoint_number(latest.name):
                    shutil.rmtree(stale, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.load_state(str(latest))
        return TrainerState(**json.loads((latest / STATE_FILE).read_text()))


