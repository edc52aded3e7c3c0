"""One epoch of training and one pass of validation, as in pytorch/examples' imagenet main.py."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from training.config import TrainingSpec
from training.engine.events import Heartbeat
from training.engine.hooks import rank_hooks
from training.engine.preemption import EpochSoFar, PreemptionNotice, StopForPreemption
from training.engine.progress import ProgressWriter, Rank


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

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 batch -> the model's normalised float input, in the chosen memory layout."""
        batch = self.normalize(images)
        return batch.contiguous(memory_format=torch.channels_last) if self.spec.channels_last \
            else batch


def train_one_epoch(learner: Learner, loader, epoch: int, so_far: EpochSoFar | None = None,
                    notice: PreemptionNotice | None = None) -> dict:
    """One epoch, or what is left of it after `so_far`; raises StopForPreemption when the ranks
    agree to stop for a notice, at a step where no gradient is half accumulated."""
    accelerator, model, optimizer = learner.accelerator, learner.model, learner.optimizer
    spec = learner.spec
    # A frozen backbone stays in eval mode: its BatchNorm statistics must not drift either.
    model.train(not spec.freeze_backbone)
    totals = torch.zeros(3, device=accelerator.device)  # loss sum, correct, images
    done = so_far.batches if so_far else 0
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
                logits = model(learner.inputs(images))
                loss = torch.nn.functional.cross_entropy(logits, labels,
                                                         label_smoothing=spec.label_smoothing)
            accelerator.backward(loss)
            optimizer.step()
            if accelerator.sync_gradients:
                learner.scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        # Counted on the device: a Python number copied up each step would wait for the GPU.
        totals[0] += loss.detach().float() * labels.numel()
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += labels.numel()
        if step % spec.heartbeat_steps == 0:
            learner.progress.emit(Heartbeat, phase="train", epoch=epoch, step=step)
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
    accelerator, model = learner.accelerator, learner.model
    model.eval()
    losses, hits = [], []
    for step, (images, labels) in enumerate(loader, start=1):
        with accelerator.autocast():
            logits = model(learner.inputs(images))
        loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
        # gather_for_metrics drops the samples the sampler duplicated to even out the ranks,
        # so each validation image counts exactly once.
        loss, hit = accelerator.gather_for_metrics((loss, logits.argmax(1) == labels))
        losses.append(loss)
        hits.append(hit)
        if step % 10 == 0:
            learner.progress.emit(Heartbeat, phase="val", epoch=epoch, step=step)
    loss, hit = torch.cat(losses), torch.cat(hits)
    return {"val_loss": loss.mean().item(), "val_accuracy": hit.float().mean().item(),
            "val_images": len(hit)}
