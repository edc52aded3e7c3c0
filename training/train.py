"""Train an image classifier from a job file, alone or under `accelerate launch`.

    # one process
    python -m training.train --job JOB.json
    # two processes with PyTorch DDP (on a CPU-only machine add ACCELERATE_USE_CPU=1)
    accelerate launch --multi_gpu --num_processes 2 -m training.train --job JOB.json
    # continue from the newest complete epoch checkpoint in the job's output folder
    accelerate launch ... -m training.train --job JOB.json --resume
    # without Prefect, log params and epoch metrics to an MLflow run (Accelerate's tracker)
    MLFLOW_TRACKING_URI=... MLFLOW_RUN_ID=... accelerate launch ... -m training.train \
        --job JOB.json --log-with mlflow

The job file is a `training.handoff.TrainJob` (the split stage's result, the training spec,
the output folder); a hand-written one may give `"manifest": ".../manifest.csv"` instead of
`"split"`, and the split's summary beside that manifest is read. Outputs in the output
folder: `best.safetensors` (+ `best.json`), `history.json`, `checkpoints/checkpoint_<epoch>/`
(Accelerate state), `progress/rank<N>.jsonl` (events). Under train-flow the task process,
not a rank, logs to MLflow (from the events), so ranks never import MLflow.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader

from trainflow_serving.networks import Normalize
from training.config import PER_MACHINE, TrainingSpec
from training.data.augment import augmentation
from training.data.cache import CachedImages, decode_split
from training.data.sides import split_sides
from training.engine.checkpoint import (
    TIES_BY,
    Checkpointer,
    TrainerState,
    project_configuration,
)
from training.engine.events import (
    EarlyStopped,
    EpochEnded,
    EpochMetrics,
    Heartbeat,
    Params,
    Predicted,
    Preempted,
    Resumed,
    Trained,
)
from training.engine.hooks import rank_hooks
from training.engine.loop import Learner, train_one_epoch, validate
from training.engine.preemption import EpochSoFar, PreemptionNotice, StopForPreemption
from training.engine.progress import ProgressWriter, Rank, task_reports
from training.engine.ranks import run_ranks
from training.engine.schedule import (
    EarlyStopping,
    backbone_parameters,
    continue_after,
    make_optimizer,
    make_scheduler,
)
from training.handoff import TrainJob, job_for_ranks
from training.models.build import load_trained, model_for, preprocessing_for
from training.processes import exit_after_teardown
from training.storage import write_json_atomic


def train(job: TrainJob, accelerator: Accelerator, rank: Rank, progress: ProgressWriter,
          resume: bool = False) -> dict:
    spec = job.training
    set_seed(spec.seed)
    cuda_defaults(accelerator, spec)
    train_loader, val_loader = make_loaders(job, accelerator, progress)
    batchnorm = batchnorm_mode(spec, accelerator.device.type, accelerator.num_processes)
    model = make_model(job, batchnorm)
    optimizer = make_optimizer(spec, model)
    model, optimizer, train_loader, val_loader = prepare_then_seed_per_rank(
        accelerator, rank, spec, model, optimizer, train_loader, val_loader)
    steps = optimizer_steps(train_loader, spec)
    scheduler = make_scheduler(spec, optimizer, steps)
    stopper = EarlyStopping(spec.early_stopping_patience, spec.early_stopping_min_delta)
    accelerator.register_for_checkpointing(scheduler, stopper)  # before any load_state
    learner = make_learner(job, accelerator, rank, progress, model, optimizer, scheduler,
                           batchnorm, steps)
    checkpoints = Checkpointer(accelerator, rank, job, model)
    notice = PreemptionNotice()  # from here on, a SIGTERM saves before it stops
    state, so_far = resume_state(learner, checkpoints, resume, steps)
    choice = epoch_choice(job, len(val_loader.dataset))
    state.chosen_by = choice.by
    report_params(job, accelerator, rank, progress, train_loader, val_loader,
                  {"batchnorm_used": batchnorm, "epoch_chosen_by": choice.by})
    if rank.main and choice.why:
        print(f"[rank {rank.index}] {choice.why}", flush=True)

    last = state.epoch if stopper.stopped else spec.epochs  # a resumed early stop stays stopped
    for epoch in range(state.epoch + 1, last + 1):
        train_loader.set_epoch(epoch)
        started = time.perf_counter() - (so_far.seconds if so_far else 0)
        try:
            trained = train_one_epoch(learner, train_loader, epoch, so_far, notice)
        except StopForPreemption as stop:
            stop.so_far.seconds = time.perf_counter() - started
            saved = checkpoints.save_interrupted(state, stop.so_far)
            progress.emit(Preempted, epoch=epoch, batches=stop.so_far.batches,
                          checkpoint=str(saved), optimizer_steps=scheduler.last_epoch)
            raise
        so_far = None
        metrics = epoch_metrics(learner, epoch, {**trained, **validate(learner, val_loader, epoch)},
                                time.perf_counter() - started)
        stop = stopper.should_stop(metrics.val_accuracy)
        keep_epoch(learner, checkpoints, state, metrics)
        if stop:  # every rank saw the same gathered metrics: all leave here together
            progress.emit(EarlyStopped, epoch=epoch, best_epoch=state.best["epoch"])
            break
    return finish(job, accelerator, rank, progress, state, checkpoints.best_weights)


def make_learner(job: TrainJob, accelerator: Accelerator, rank: Rank, progress: ProgressWriter,
                 model: torch.nn.Module, optimizer, scheduler, batchnorm: str,
                 steps: int) -> Learner:
    """What one step needs, the prepared model compiled when asked."""
    spec, pre = job.training, preprocessing_for(job)
    # Compiled after prepare(), so that DDP wraps the original module (gradient all-reduce
    # overlaps backward) and the checkpoints, which hold the prepared module, stay plain.
    stepping = torch.compile(model) if spec.compile else model
    return Learner(accelerator, stepping, optimizer, scheduler,
                   Normalize(pre.mean, pre.std).to(accelerator.device), spec, rank, progress,
                   augment=augmentation(spec), batchnorm=batchnorm,
                   freeze_steps=round(spec.freeze_epochs * steps),
                   backbone=backbone_parameters(optimizer), metric=job.metric,
                   class_weights=loss_weights(job, accelerator.device))


def loss_weights(job: TrainJob, device: torch.device) -> torch.Tensor | None:
    """training.class_weights "balanced": n / (classes x n_c) per class c of the train split,
    scikit-learn's class_weight="balanced"; a class with no train image weighs nothing."""
    if job.training.class_weights == "none":
        return None
    counts = [job.split.counts["train"].get(name, 0) for name in job.split.class_names]
    total, classes = sum(counts), len(counts)
    return torch.tensor([total / (classes * n) if n else 0.0 for n in counts],
                        dtype=torch.float32, device=device)


def resume_state(learner: Learner, checkpoints: Checkpointer, resume: bool, steps: int
                 ) -> tuple[TrainerState, EpochSoFar | None]:
    """The loop's state from the newest checkpoint (a fresh one without), the schedule moved
    to where it stopped, and the part of an epoch a preemption left done."""
    spec, scheduler, optimizer = learner.spec, learner.scheduler, learner.optimizer
    state = (checkpoints.resume() if resume else None) or TrainerState()
    so_far = EpochSoFar(**state.interrupted) if state.interrupted else None
    if state.epoch and so_far is None:
        continue_after(scheduler, lambda: make_scheduler(spec, optimizer, steps), state.epoch,
                       steps)
    if state.epoch or so_far:  # mid-epoch, the restored schedule is exactly where it stopped
        learner.progress.emit(Resumed, checkpoint=str(checkpoints.latest()), epoch=state.epoch,
                              batches=so_far.batches if so_far else 0)
    return state, so_far


def epoch_metrics(learner: Learner, epoch: int, figures: dict, seconds: float) -> EpochMetrics:
    return EpochMetrics(epoch=epoch, epoch_seconds=seconds,
                        images_per_second=figures.pop("train_images") / seconds,
                        learning_rate=learner.optimizer.param_groups[0]["lr"],
                        optimizer_steps=learner.scheduler.last_epoch,  # it counts the steps
                        **figures)


def keep_epoch(learner: Learner, checkpoints: Checkpointer, state: TrainerState,
               metrics: EpochMetrics) -> None:
    """The epoch recorded (the best so far or not), saved, and reported."""
    rank, spec, epoch = learner.rank, learner.spec, metrics.epoch
    is_best = state.record(epoch, metrics.figures())
    checkpoint = checkpoints.save(epoch, state, is_best)
    learner.accelerator.log(metrics.figures(), step=epoch)
    learner.progress.emit(EpochEnded, epoch=epoch, epochs=spec.epochs, metrics=metrics,
                          is_best=is_best, checkpoint=str(checkpoint), world_size=rank.world)
    if rank.main and not task_reports():  # else the task says it once
        print(f"[rank {rank.index}] epoch {epoch}/{spec.epochs} " + " ".join(
            f"{k}={v:.4g}" for k, v in metrics.figures().items()), flush=True)


def prepare_then_seed_per_rank(accelerator: Accelerator, rank: Rank, spec: TrainingSpec,
                               *objects):
    """`accelerator.prepare`, then a seed per rank.

    The initial weights and the samplers (seeded inside prepare) share one seed on every rank,
    so the ranks' shards stay disjoint; from here each rank draws its own crops and flips
    (and dropout), not a copy of rank 0's.
    """
    prepared = accelerator.prepare(*objects)
    set_seed(spec.seed + rank.index)
    return prepared


def batchnorm_mode(spec: TrainingSpec, device_type: str, processes: int) -> str:
    """training.batchnorm decided for this launch: "train", "frozen" or "sync"."""
    if spec.batchnorm != "auto":
        if spec.batchnorm == "sync" and device_type != "cuda":
            raise ValueError("training.batchnorm \"sync\" needs CUDA processes (torch's "
                             "SyncBatchNorm); on the CPU use \"frozen\" or \"train\"")
        return spec.batchnorm
    shared = device_type == "cuda" and processes > 1  # SyncBatchNorm runs on CUDA only
    per_statistic = spec.batch_size * (processes if shared else 1)
    if spec.starts_from_weights and per_statistic < FROZEN_BELOW:
        # A few images' mean and variance are noise beside the ones the weights were trained
        # with; measured on real photos (bench/RESULTS.md, "Fine-tuning real weights").
        return "frozen"
    return "sync" if shared else "train"


FROZEN_BELOW = 32
"""With pretrained weights, BatchNorm statistics over fewer images than this are frozen."""


@dataclass(frozen=True)
class EpochChoice:
    by: str
    """A rule of training.engine.checkpoint.better."""
    why: str = ""


def epoch_choice(job: TrainJob, val_images: int) -> EpochChoice:
    """How the kept epoch is chosen, and why when it is the last one for want of images.

    auto: on the val figure of the metric the gate compares (job.metric), where the gate would
    choose; two epochs within the val split's noise of each other by the lower val loss, which
    is steadier than a few hundred images' accuracy (bench/RESULTS.md, "The kept epoch")."""
    spec = job.training
    if spec.choose_epoch != "auto":
        return EpochChoice(spec.choose_epoch)
    if val_images < spec.choose_min_val_images:
        return EpochChoice("last", f"keeping the last epoch, not the best on validation: the "
                           f"val split has {val_images} images, under choose_min_val_images "
                           f"{spec.choose_min_val_images}, where choosing is noise")
    return EpochChoice(f"val_{job.metric}{TIES_BY}val_loss")


def make_model(job: TrainJob, batchnorm: str = "train") -> torch.nn.Module:
    model = model_for(job)
    if batchnorm == "sync":
        # Each rank's BatchNorm would otherwise see only its share of the batch (8 of 16
        # images on 2 GPUs), which measurably costs a fine-tune accuracy (bench/RESULTS.md).
        # The layers keep their parameter names, so the weights load into plain BatchNorm.
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if job.training.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def cuda_defaults(accelerator: Accelerator, spec: TrainingSpec) -> None:
    """Fast CUDA settings that cost no accuracy for these fixed-size images: cuDNN picks the
    fastest kernels for the one input shape, and fp32 matmuls use TF32 (mixed_precision "no"
    only; TRAINFLOW_TF32=0 turns it off)."""
    if accelerator.device.type != "cuda":
        return
    torch.backends.cudnn.benchmark = True
    if spec.mixed_precision == "no" and os.environ.get("TRAINFLOW_TF32", "1") != "0":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def optimizer_steps(loader: DataLoader, spec: TrainingSpec) -> int:
    """Optimizer steps per epoch on this rank's share of the data."""
    return math.ceil(len(loader) / spec.gradient_accumulation_steps)


def make_loaders(job: TrainJob, accelerator: Accelerator, progress: ProgressWriter
                 ) -> tuple[DataLoader, DataLoader]:
    spec, pre = job.training, preprocessing_for(job)
    sides = split_sides(spec)

    def decoding(split):
        def on_progress(done: int, total: int) -> None:
            progress.emit(Heartbeat, phase=f"decode {split}", step=done, total=total)
            rank_hooks().on_decode_progress(done, total)
        return on_progress

    # Whatever the split stage left undecoded is decoded once, by whichever rank takes the
    # store's lock first; the others wait on that lock, not in a collective, which a long
    # decode would time out (NCCL gives up after 10 minutes).
    train = decode_split(job.split, "train", sides["train"], pre.channels, decoding("train"))
    val = decode_split(job.split, "val", sides["val"], pre.channels, decoding("val"))
    # Batches stay uint8 until the device (4x fewer bytes to copy); Normalize runs there.
    workers = spec.workers_per_rank(
        accelerator.device.type == "cuda", len(os.sched_getaffinity(0)),
        int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)))
    # The loader's own generator: its per-epoch draw then leaves the global stream (dropout,
    # crops) alone, so a run resumed mid-epoch draws exactly what the uninterrupted one did.
    loading = {"batch_size": spec.batch_size, "num_workers": workers,
               "persistent_workers": workers > 0,
               "pin_memory": accelerator.device.type == "cuda"}
    return (DataLoader(CachedImages(train), shuffle=True,
                       generator=torch.Generator().manual_seed(spec.seed), **loading),
            DataLoader(CachedImages(val),
                       generator=torch.Generator().manual_seed(spec.seed), **loading))


def report_params(job: TrainJob, accelerator: Accelerator, rank: Rank, progress: ProgressWriter,
                  train_loader: DataLoader, val_loader: DataLoader, decided: dict) -> None:
    params = {**job.training.model_dump(exclude=PER_MACHINE), **decided, "world_size": rank.world,
              "loader_workers": train_loader.num_workers,  # what "auto" became here
              "train_images": len(train_loader.dataset), "val_images": len(val_loader.dataset),
              "classes": len(job.split.class_names)}
    accelerator.init_trackers(os.environ.get("MLFLOW_EXPERIMENT_NAME", "train-flow"), params)
    if rank.main:
        progress.emit(Params, params=params)


def finish(job: TrainJob, accelerator: Accelerator, rank: Rank, progress: ProgressWriter,
           state: TrainerState, weights: Path) -> dict:
    accelerator.wait_for_everyone()
    result = {"world_size": rank.world, "best": state.best, "history": state.history,
              "chosen_by": state.chosen_by,
              "weights": str(weights), "preprocessing": preprocessing_for(job).model_dump()}
    if rank.main:
        load_trained(job, weights)  # the saved weights load strictly before success is reported
        write_json_atomic(job.output_dir / "history.json", result)
    progress.emit(Trained, **result)
    return result


COLLECTIVE_TIMEOUT = "TRAINFLOW_COLLECTIVE_TIMEOUT_S"
"""How long a rank waits in one collective before failing (torch's default otherwise: 10 min
with NCCL, 30 with gloo). The hang watchdog (hang_timeout_s) stops a stuck run before either."""


def make_accelerator(job: TrainJob, log_with: str | None = None) -> Accelerator:
    timeout = os.environ.get(COLLECTIVE_TIMEOUT)
    return Accelerator(mixed_precision=job.training.mixed_precision, log_with=log_with,
                       kwargs_handlers=[InitProcessGroupKwargs(
                           timeout=timedelta(seconds=float(timeout)))] if timeout else None,
                       gradient_accumulation_steps=job.training.gradient_accumulation_steps,
                       # non_blocking: with pinned batches, the copy to the GPU overlaps compute.
                       dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True,
                                                                 non_blocking=True),
                       project_config=project_configuration(job.output_dir))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", type=Path, required=True,
                        help="job file (JSON), e.g. --job runs/123/train/job.json")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint, if any")
    parser.add_argument("--evaluate-into", type=Path, metavar="DIR",
                        help="then predict the test split with the best weights into DIR "
                        "(logits.safetensors, predictions.csv), in the same processes; "
                        "training.evaluate.write_results makes the metrics and pictures")
    parser.add_argument("--log-with", choices=["mlflow"],
                        help="log from the main process through Accelerate's tracker (the run "
                        "named by MLFLOW_RUN_ID, else a new one); train-flow does not need it")
    args = parser.parse_args(argv)
    job = job_for_ranks(args.job)
    with run_ranks(job.output_dir, lambda: make_accelerator(job, args.log_with)) as (
            accelerator, rank, progress):  # passed everywhere
        try:
            result = train(job, accelerator, rank, progress, resume=args.resume)
        except StopForPreemption:  # saved and reported: leave cleanly, for the retry
            raise SystemExit(0) from None
        if args.evaluate_into:
            # A second launch would start interpreters, torch and the process group again.
            from training.evaluate import predict_into

            images = predict_into(job, Path(result["weights"]), args.evaluate_into,
                                  accelerator, rank, progress)
            accelerator.wait_for_everyone()
            if images is not None:
                progress.emit(Predicted, images=images, world_size=rank.world,
                              out=str(args.evaluate_into))


if __name__ == "__main__":
    main()
    exit_after_teardown()
