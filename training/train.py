"""Train an image classifier from a job file, alone or under `accelerate launch`.

    # one process
    python -m training.train --job JOB.json
    # two processes with PyTorch DDP (on a CPU-only machine add ACCELERATE_USE_CPU=1)
    accelerate launch --multi_gpu --num_processes 2 -m training.train --job JOB.json
    # continue from the newest epoch checkpoint in the job's output folder
    accelerate launch ... -m training.train --job JOB.json --resume

The job file is a `training.config.TrainJob` (manifest, training spec, output folder, MLflow
run id). Outputs in the output folder: `best.safetensors` (+ `best.json`), `history.json`,
`checkpoints/epoch_NNNN/` (Accelerate state), `progress/rank<N>.jsonl` (events).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from safetensors.torch import load_model, save_model
from torch.utils.data import DataLoader

from training.config import TrainingSpec, TrainJob
from training.data import CachedImages, Normalize, cache_side, decode_split
from training.faults import die_with_parent, inject_fault
from training.models import build_model, input_channels, normalization
from training.progress import ProgressWriter
from training.split import read_summary
from training.storage import atomic_path, write_json_atomic
from training.tracking import RunLogger

KEEP_CHECKPOINTS = 2


def load_job(path: Path) -> TrainJob:
    try:
        return TrainJob.model_validate_json(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"job file {path} does not exist") from None
    except ValueError as e:
        raise SystemExit(f"job file {path} is not a valid training job: {e}") from None


def train(job: TrainJob, resume: bool = False) -> dict:
    spec = job.training
    out = job.output_dir
    accelerator = Accelerator(
        mixed_precision=spec.mixed_precision,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    # Who this process is, decided once; the loop below reads these names.
    is_main, rank, world = (accelerator.is_main_process, accelerator.process_index,
                            accelerator.num_processes)
    progress = ProgressWriter(out, rank)
    progress.emit("start", world_size=world, device=str(accelerator.device), pid=os.getpid(),
                  threads=torch.get_num_threads())
    set_seed(spec.seed)

    summary = read_summary(job.manifest)
    channels = input_channels(spec.model, summary.channels)
    augment = spec.augment == "flip_crop" or (spec.augment == "auto" and summary.channels == 3)
    def decoding(split):
        return lambda done, total: progress.emit("heartbeat", phase=f"decode {split}",
                                                 step=done, total=total)

    # Only the main process decodes; the others wait and then map the same cache files.
    with accelerator.main_process_first():
        cache_dir = job.manifest.parent / "cache"
        train_x, train_y, _ = decode_split(summary.root, job.manifest, "train",
                                           cache_side(spec.image_size, augment), channels,
                                           cache_dir, decoding("train"))
        val_x, val_y, _ = decode_split(summary.root, job.manifest, "val", spec.image_size,
                                       channels, cache_dir, decoding("val"))
    train_loader = DataLoader(CachedImages(train_x, train_y, spec.image_size, augment),
                              batch_size=spec.batch_size, shuffle=True)
    val_loader = DataLoader(CachedImages(val_x, val_y, spec.image_size, False),
                            batch_size=spec.batch_size)

    model = build_model(spec.model, len(summary.class_names), channels, spec.image_size,
                        spec.pretrained)
    mean, std = normalization(spec.model, spec.pretrained, channels)
    normalize = Normalize(mean, std).to(accelerator.device)
    optimizer = make_optimizer(spec, model)
    model, optimizer, train_loader, val_loader = accelerator.prepare(
        model, optimizer, train_loader, val_loader
    )

    tracker = RunLogger(job.mlflow_run_id if is_main else None, job.mlflow_tracking_uri,
                        on_error=lambda msg: progress.emit("mlflow_error", message=msg))
    state = {"epoch": 0, "best": None, "history": []}
    if resume and (checkpoint := latest_checkpoint(out)):
        accelerator.load_state(checkpoint)
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        progress.emit("resumed", checkpoint=str(checkpoint), epoch=state["epoch"])
    params = {**spec.model_dump(exclude={"main_process_ip"}), "world_size": world,
              "train_images": len(train_y), "val_images": len(val_y),
              "classes": len(summary.class_names)}
    tracker.log_params(params)
    if is_main:
        progress.emit("params", params=params)

    for epoch in range(state["epoch"] + 1, spec.epochs + 1):
        train_loader.set_epoch(epoch)
        started = time.perf_counter()
        train_metrics = train_one_epoch(accelerator, model, normalize, optimizer, train_loader,
                                        progress, spec, epoch)
        val_metrics = validate(accelerator, model, normalize, val_loader, progress, epoch)
        seconds = time.perf_counter() - started
        images = train_metrics.pop("train_images")
        metrics = {**train_metrics, **val_metrics, "epoch_seconds": seconds,
                   "images_per_second": images / seconds,
                   "learning_rate": optimizer.param_groups[0]["lr"]}
        is_best = state["best"] is None or better(metrics, state["best"])
        if is_best:
            state["best"] = {"epoch": epoch, **metrics}
            if is_main:
                save_best_weights(accelerator.unwrap_model(model), out, state["best"])
        state["epoch"] = epoch
        state["history"].append({"epoch": epoch, **metrics})
        checkpoint = save_checkpoint(accelerator, out, epoch, state, job)
        tracker.log_metrics(metrics, step=epoch)
        progress.emit("epoch", epoch=epoch, epochs=spec.epochs, metrics=metrics,
                      is_best=is_best, checkpoint=str(checkpoint), world_size=world)
        if is_main:
            print(f"[rank {rank}] epoch {epoch}/{spec.epochs} " + " ".join(
                f"{k}={v:.4g}" for k, v in metrics.items()), flush=True)

    accelerator.wait_for_everyone()
    result = {"world_size": world, "best": state["best"], "history": state["history"],
              "weights": str(out / "best.safetensors")}
    if is_main:
        verify_best_weights(spec, len(summary.class_names), channels, out)
        write_json_atomic(out / "history.json", result)
        unsent = tracker.flush()
        result["mlflow_unsent"] = unsent
        if unsent:
            progress.emit("mlflow_error", message=f"{unsent} metric batches could not be logged")
    progress.emit("done", **result)
    accelerator.end_training()
    return result


def make_optimizer(spec: TrainingSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = model.parameters()
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=0.9, weight_decay=spec.weight_decay)
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)


def train_one_epoch(accelerator, model, normalize, optimizer, loader, progress, spec, epoch) -> dict:
    model.train()
    totals = torch.zeros(3, device=accelerator.device)  # loss sum, correct, images
    if progress.rank == 0 and sys.stdout.isatty():  # a bar for people; plain lines for logs
        from tqdm import tqdm

        loader = tqdm(loader, desc=f"epoch {epoch}", leave=False)
    for step, (images, labels) in enumerate(loader, start=1):
        inject_fault(progress.rank, epoch, step)
        with accelerator.autocast():
            logits = model(normalize(images))
            loss = torch.nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        optimizer.step()
        totals += torch.stack([loss.detach().float() * len(labels),
                               (logits.argmax(1) == labels).sum().float(),
                               torch.tensor(float(len(labels)), device=totals.device)])
        if step % spec.heartbeat_steps == 0:
            progress.emit("heartbeat", phase="train", epoch=epoch, step=step)
    # Summed over ranks: the sampler pads the last round, so a few images may count twice
    # in training metrics; validation below is exact.
    loss_sum, correct, images = accelerator.reduce(totals, reduction="sum").tolist()
    return {"train_loss": loss_sum / images, "train_accuracy": correct / images,
            "train_images": images}


@torch.no_grad()
def validate(accelerator, model, normalize, loader, progress, epoch) -> dict:
    model.eval()
    losses, hits = [], []
    for step, (images, labels) in enumerate(loader, start=1):
        with accelerator.autocast():
            logits = model(normalize(images))
        loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
        # gather_for_metrics drops the samples the sampler duplicated to even out the ranks,
        # so each validation image counts exactly once.
        loss, hit = accelerator.gather_for_metrics((loss, logits.argmax(1) == labels))
        losses.append(loss)
        hits.append(hit)
        if step % 10 == 0:
            progress.emit("heartbeat", phase="val", epoch=epoch, step=step)
    loss, hit = torch.cat(losses), torch.cat(hits)
    return {"val_loss": loss.mean().item(), "val_accuracy": hit.float().mean().item(),
            "val_images": len(hit)}


def better(metrics: dict, best: dict) -> bool:
    """Higher validation accuracy wins; on a tie, lower validation loss."""
    if metrics["val_accuracy"] != best["val_accuracy"]:
        return metrics["val_accuracy"] > best["val_accuracy"]
    return metrics["val_loss"] < best["val_loss"]


def save_best_weights(model: torch.nn.Module, out: Path, best: dict) -> None:
    # The unwrapped model has no "module." (DDP) or "_orig_mod." (compile) prefixes.
    with atomic_path(out / "best.safetensors") as tmp:
        save_model(model, str(tmp), metadata={"epoch": str(best["epoch"])})
    write_json_atomic(out / "best.json", best)


def verify_best_weights(spec: TrainingSpec, num_classes: int, channels: int, out: Path) -> None:
    """Reload the saved weights strictly into a fresh model before reporting success."""
    fresh = build_model(spec.model, num_classes, channels, spec.image_size, pretrained=False)
    missing, unexpected = load_model(fresh, str(out / "best.safetensors"), strict=True)
    if missing or unexpected:
        raise RuntimeError(f"best weights do not match the model: {missing=} {unexpected=}")


def save_checkpoint(accelerator, out: Path, epoch: int, state: dict, job: TrainJob) -> Path:
    folder = out / "checkpoints" / f"epoch_{epoch:04d}"
    accelerator.save_state(str(folder))
    if accelerator.is_main_process:
        # Written last: a checkpoint without it is incomplete and never resumed from.
        write_json_atomic(folder / "job.json", json.loads(job.model_dump_json()))
        write_json_atomic(folder / "trainer_state.json", state)
        for old in sorted((out / "checkpoints").glob("epoch_*"))[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return folder


def latest_checkpoint(out: Path) -> Path | None:
    done = sorted(p.parent for p in (out / "checkpoints").glob("epoch_*/trainer_state.json"))
    return done[-1] if done else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", type=Path, required=True,
                        help="job file (JSON), e.g. --job runs/123/job.json")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint, if any")
    args = parser.parse_args(argv)
    die_with_parent()
    job = load_job(args.job)
    rank = int(os.environ.get("RANK", "0"))
    try:
        train(job, resume=args.resume)
    except BaseException as e:
        if not isinstance(e, SystemExit | KeyboardInterrupt):
            ProgressWriter(job.output_dir, rank).emit(
                "error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        raise


if __name__ == "__main__":
    sys.exit(main())
