"""The GPU benchmark: one command on a GPU machine, a reduced mode on a CPU (tested in CI).

    .venv/bin/python -m bench.gpu --write     # on a GPU machine: full sizes, table into RESULTS
    .venv/bin/python -m bench.gpu --cpu       # reduced: small images and batches, no CUDA

1. The input pipeline alone, per rank: our CachedImages crop_flip through a DataLoader, at
   224 px (CPU: 64 px), loader_workers 0/2/4/8 (CPU: 0/1), images/s; against it, the other
   way: uint8 batches copied to the device as they are, crop+flip there for the whole batch
   (one affine grid per image). The faster one is what training should use on GPUs.
2. The step alone, batch already on the device: resnet18 forward+backward+SGD for fp32/bf16 x
   channels_last x cudnn.benchmark at batch 64/128/256 (CPU: fp32, batch 16, 64 px), timed
   with CUDA events (CPU: perf_counter), images/s.
3. End to end: the train task's launcher on generated photos, epoch-2 images/s at 1 process and
   at every GPU (CPU: 2 processes only, to keep its CI run short), plus a 20-step
   torch.profiler table of one step loop.
4. Smoke: a 2-process run with compile: true to loadable weights.

Alternate nothing here: each row is one configuration's median of --repeats timings.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADING = "## GPU benchmark (bench/gpu.py)"
CROP_SCALE = (0.7, 1.0)  # training's crop_min_scale from scratch


class Images:
    """Decoded uint8 images as the decode store hands them to CachedImages."""

    def __init__(self, count: int, side: int):
        rng = np.random.default_rng(0)
        self.rows = rng.integers(0, 256, (count, 3, side, side), dtype=np.uint8)
        self.labels = rng.integers(0, 2, count)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.rows[i]


class Augmented(torch.utils.data.Dataset):
    """Training's per-image augmentation run in the loader (its workers), not on the device."""

    def __init__(self, inner, augment):
        self.inner, self.augment = inner, augment

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        image, label = self.inner[i]
        return self.augment(image), label


def loader_rate(side: int, workers: int, batches: int, batch: int) -> float:
    from torch.utils.data import DataLoader

    from training.config import TrainingSpec
    from training.data.augment import augmentation
    from training.data.cache import CachedImages

    data = Augmented(CachedImages(Images(batch * batches, int(side * 1.15))),
                     augmentation(TrainingSpec(image_size=side, augment="crop_flip")))
    loader = DataLoader(data, batch_size=batch, num_workers=workers, shuffle=True,
                        persistent_workers=workers > 0)
    started = time.perf_counter()
    seen = sum(len(labels) for _, labels in loader)
    return seen / (time.perf_counter() - started)


def crop_flip_on_device(batch: torch.Tensor, side: int) -> torch.Tensor:
    """uint8 [N, C, H, W] on the device -> float [N, C, side, side]: per image a random square
    crop of CROP_SCALE of its area and a coin-flip mirror, as training.data.augment does per
    image."""
    import torch.nn.functional as F

    n, device = batch.shape[0], batch.device
    scale = torch.empty(n, device=device).uniform_(*CROP_SCALE).sqrt()  # side of the crop
    shift = (torch.rand(n, 2, device=device) * 2 - 1) * (1 - scale)[:, None]
    mirror = torch.where(torch.rand(n, device=device) < 0.5, -1.0, 1.0)
    theta = torch.zeros(n, 2, 3, device=device)
    theta[:, 0, 0], theta[:, 1, 1] = scale * mirror, scale
    theta[:, :, 2] = shift
    grid = F.affine_grid(theta, [n, batch.shape[1], side, side], align_corners=False)
    return F.grid_sample(batch.float(), grid, mode="bilinear", align_corners=False)


def device_augment_rate(device: str, side: int, batches: int, batch: int) -> float:
    """The same images and batches, cropped and flipped on the device after the copy."""
    from torch.utils.data import DataLoader

    from training.data.cache import CachedImages

    data = CachedImages(Images(batch * batches, int(side * 1.15)))
    loader = DataLoader(data, batch_size=batch, shuffle=True, pin_memory=device == "cuda")
    started, seen = time.perf_counter(), 0
    for images, labels in loader:
        out = crop_flip_on_device(images.to(device, non_blocking=True), side)
        seen += len(labels)
    if device == "cuda":
        torch.cuda.synchronize()
    assert out.shape[-1] == side
    return seen / (time.perf_counter() - started)


def step_rate(device: str, dtype: str, channels_last: bool, benchmark: bool, batch: int,
              side: int, steps: int) -> float:
    from torchvision.models import resnet18

    torch.backends.cudnn.benchmark = benchmark
    model = resnet18(num_classes=2).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(batch, 3, side, side, device=device)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 2, (batch,), device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16")

    def step() -> None:
        with autocast:
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(3):
        step()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1000
    else:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        seconds = time.perf_counter() - started
    return batch * steps / seconds


def profile_table(device: str, side: int, batch: int) -> str:
    from torch.profiler import ProfilerActivity, profile
    from torchvision.models import resnet18

    model = resnet18(num_classes=2).to(device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images = torch.randn(batch, 3, side, side, device=device)
    labels = torch.randint(0, 2, (batch,), device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(20):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=8)


def end_to_end(folder: Path, side: int, processes: list[int], epochs: int, compile_: bool = False
               ) -> dict[int, tuple[float, int]]:
    """Epoch-2 (last epoch) images/s and world size of the train task's launch."""
    from bench.make_photos import make
    from tasks.train import run_training
    from training.config import DatasetSpec, SplitSpec
    from training.data.sources import prepare
    from training.data.split import split_dataset
    from training.handoff import TrainJob

    photos = make(folder / "photos", 60)
    ref = prepare(DatasetSpec(source=str(photos), labels="filename"), folder / "home")
    split = split_dataset(ref, SplitSpec(), folder / "home")
    rates = {}
    for n in processes:
        job = TrainJob(split=split, output_dir=folder / f"run-{n}-{compile_}", training={
            "model": "resnet18", "image_size": side, "epochs": epochs, "batch_size": 16,
            "num_processes": n, "augment": "crop_flip", "compile": compile_})
        result = run_training(job, logging.getLogger("bench"))
        rates[n] = (result.history[-1].images_per_second, result.world_size)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the reduced mode (no CUDA needed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="append the tables to RESULTS.md")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    device = "cuda" if cuda else "cpu"
    side, workers = (224, [0, 2, 4, 8]) if cuda else (64, [0, 1])
    batches = [64, 128, 256] if cuda else [16]
    dtypes = ["fp32", "bf16"] if cuda else ["fp32"]
    gpus = torch.cuda.device_count() if cuda else 0
    out = [HEADING, "", f"Device: {torch.cuda.get_device_name(0) if cuda else 'CPU (reduced mode)'}"
           f", torch {torch.__version__}, {time.strftime('%Y-%m-%d')}.", ""]

    out += ["| input pipeline per rank (crop_flip) | images/s |", "|---|---|"]
    for w in workers:
        rate = statistics.median(loader_rate(side, w, 8, 32) for _ in range(args.repeats))
        out.append(f"| {side} px, loader_workers {w} | {rate:.0f} |")
    rate = statistics.median(device_augment_rate(device, side, 8, 32)
                             for _ in range(args.repeats))
    out.append(f"| {side} px, loader_workers 0, crop+flip of the batch on the {device} | "
               f"{rate:.0f} |")

    out += ["", "| step alone, resnet18 | batch | images/s |", "|---|---|---|"]
    for dtype in dtypes:
        for channels_last in (False, True):
            for benchmark in ((False, True) if cuda else (False,)):
                for batch in batches:
                    rate = statistics.median(
                        step_rate(device, dtype, channels_last, benchmark, batch, side,
                                  20 if cuda else 2) for _ in range(args.repeats))
                    out.append(f"| {dtype}, channels_last {channels_last}, cudnn.benchmark "
                               f"{benchmark} | {batch} | {rate:.0f} |")

    with tempfile.TemporaryDirectory() as tmp:
        counts = [1, gpus] if gpus > 1 else [1] if cuda else [2]
        rates = end_to_end(Path(tmp), side, counts, epochs=2)
        out += ["", "| end to end (train task launch, generated photos) | world size | "
                "epoch-2 images/s |", "|---|---|---|"]
        out += [f"| {n} process(es) | {world} | {rate:.0f} |" for n, (rate, world) in
                rates.items()]
        if gpus >= 2 or not cuda:
            [(_, (rate, world))] = end_to_end(Path(tmp), side, [2], epochs=1,
                                              compile_=True).items()
            out += ["", f"compile smoke: 2 processes with compile: true ran to loadable "
                    f"weights (world size {world}, {rate:.0f} images/s in its only epoch)."]
    out += ["", "Profile of 20 steps (resnet18, channels_last):", "", "```",
            profile_table(device, side, batches[0]), "```", ""]
    text = "\n".join(out)
    print(text)
    if args.write:
        with open(RESULTS, "a") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
