"""One epoch of training and one pass of validation, as in pytorch/examples' imagenet main.py."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator

from training.config import TrainingSpec
from training.engine.events import Heartbeat
from training.engine.hooks import rank_hooks
from training.engine.preemption import EpochSoFar, PreemptionNotice, StopForPreemption
from training.engine.progress import ProgressWriter, Rank

BATCHNORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d,
              torch.nn.SyncBatchNorm)


@dataclass
class Learner:
    """The prepared objects one step needs, built once by the entry point."""

    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    normalize: torch.nn.Module
    spec: TrainingSpec
    rank: Rank
    progress: ProgressWriter
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None
    """uint8 [C, H, W] -> uint8 [C, image_size, image_size], one image's random draw."""
    batchnorm: str = "train"
    """What training.batchnorm became on this rank: "train", "frozen" or "sync"."""
    freeze_steps: int = 0
    """Optimizer steps (from the run's start) during which only the head learns."""
    backbone: list[torch.Tensor] = field(default_factory=list)
    metric: str = "accuracy"
    """The metric the gate compares (TrainJob.metric): its val figure is computed each epoch."""
    class_weights: torch.Tensor | None = None
    """Per class, on the device: training.class_weights "balanced" (None: all alike)."""

    def inputs(self, images: torch.Tensor, train: bool = False) -> torch.Tensor:
        """uint8 batch -> the model's normalised float input, in the chosen memory layout;
        `train`: each image augmented first, where the batch is (on the GPU when there is
        one), from the uint8 pixels the store holds."""
        if train and self.augment is not None:
            images = torch.stack([self.augment(image) for image in images])
        batch = self.normalize(images)
        return batch.contiguous(memory_format=torch.channels_last) if self.spec.channels_last \
            else batch

    @property
    def head_only(self) -> bool:
        return self.scheduler.last_epoch < self.freeze_steps

    def set_modes(self) -> None:
        """Train mode, but for what must not drift: a frozen backbone stays in eval mode
        (BatchNorm statistics included); frozen BatchNorm, or any while the head learns
        alone, keeps the statistics the weights came with (scale and shift still learn)."""
        self.model.train(not self.spec.freeze_backbone)
        if self.batchnorm == "frozen" or self.head_only:
            for module in self.model.modules():
                if isinstance(module, BATCHNORMS):
                    module.eval()


def train_one_epoch(learner: Learner, loader, epoch: int, so_far: EpochSoFar | None = None,
                    notice: PreemptionNotice | None = None) -> dict:
    """One epoch, or what is left of it after `so_far`; raises StopForPreemption when the ranks
    agree to stop for a notice, at a step where no gradient is half accumulated."""
    accelerator, model, optimizer = learner.accelerator, learner.model, learner.optimizer
    spec = learner.spec
    learner.set_modes()
    totals = torch.zeros(3, device=accelerator.device)  # loss sum, correct, images
    done = so_far.batches if so_far else 0
    batches = len(loader)
    if done:
        if learner.rank.main:  # the sums over every rank so far, counted once
            totals += torch.tensor(so_far.sums, device=accelerator.device)
        loader = accelerator.skip_first_batches(loader, done)  # the same order, from batch done+1
    if learner.rank.main and sys.stdout.isatty():  # a bar for people; plain lines for logs
        from tqdm import tqdm

        loader = tqdm(loader, desc=f"epoch {epoch}", leave=False)
    on_step = rank_hooks().on_step
    for step, (images, labels) in enumerate(loader, done + 1):
        on_step(learner.rank.index, epoch, step)
        # accumulate() skips the gradient sync and the optimizer step on all but every
        # gradient_accumulation_steps-th batch, and scales the loss to match.
        with accelerator.accumulate(model):
            with accelerator.autocast():
                logits = model(learner.inputs(images, train=True))
                loss = torch.nn.functional.cross_entropy(
                    logits, labels, weight=learner.class_weights,
                    label_smoothing=spec.label_smoothing)
            accelerator.backward(loss)
            head_only = learner.head_only
            if head_only:  # an optimizer skips a parameter without a gradient: no decay, no
                for p in learner.backbone:  # momentum, the pretrained weights untouched
                    p.grad = None
            optimizer.step()
            if accelerator.sync_gradients:
                learner.scheduler.step()
                if head_only and not learner.head_only:  # every layer learns from here on
                    learner.set_modes()
            optimizer.zero_grad(set_to_none=True)
        # Counted on the device: a Python number copied up each step would wait for the GPU.
        totals[0] += loss.detach().float() * labels.numel()
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += labels.numel()
        if step % spec.heartbeat_steps == 0:
            learner.progress.emit(Heartbeat, phase="train", epoch=epoch, step=step,
                                  total=batches, images=labels.numel())
        if (notice is not None and accelerator.sync_gradients
                and learner.scheduler.last_epoch % spec.heartbeat_steps == 0
                and notice.agreed(accelerator)):
            sums = accelerator.reduce(totals.clone(), reduction="sum").tolist()
            raise StopForPreemption(EpochSoFar(step, sums, world_size=learner.rank.world))
    # Summed over ranks: the sampler pads the last round, so a few images may count twice
    # in training metrics; validation below is exact.
    loss_sum, correct, images = accelerator.reduce(totals, reduction="sum").tolist()
    return {"train_loss": loss_sum / images, "train_accuracy": correct / images,
            "train_images": images}


@torch.no_grad()
def validate(learner: Learner, loader, epoch: int) -> dict:
    """The val split's loss and accuracy, and when the gate compares another metric (macro F1,
    ROC AUC) that one too, computed as the test split's are (scikit-learn is imported into the
    ranks only then)."""
    accelerator, model = learner.accelerator, learner.model
    model.eval()
    outputs, targets = [], []
    for step, (images, labels) in enumerate(loader, start=1):
        with accelerator.autocast():
            logits = model(learner.inputs(images))
        # gather_for_metrics drops the samples the sampler duplicated to even out the ranks,
        # so each validation image counts exactly once.
        logits, labels = accelerator.gather_for_metrics((logits.float(), labels))
        outputs.append(logits)
        targets.append(labels)
        if step % 10 == 0:
            learner.progress.emit(Heartbeat, phase="val", epoch=epoch, step=step,
                                  total=len(loader))
    logits, labels = torch.cat(outputs).cpu(), torch.cat(targets).cpu()
    figures = {"val_loss": torch.nn.functional.cross_entropy(logits, labels).item(),
               "val_accuracy": (logits.argmax(1) == labels).float().mean().item(),
               "val_images": len(labels)}
    if learner.metric != "accuracy":
        from training.evaluation.metrics import compute_metrics

        named = compute_metrics(logits, labels, [str(k) for k in range(logits.shape[1])])
        figures[f"val_{learner.metric}"] = named[learner.metric]
    return figures
