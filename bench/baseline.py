"""The hand-written baseline: a single-file Accelerate script as the dogs-vs-cats tutorial does it.

An ImageFolder-style dataset that opens and transforms every image with PIL on every access,
a DataLoader with shuffle, `prepare`, `backward`, `gather` for validation accuracy. Same
manifest, model, image size, batch size and epochs as our training; it prints one JSON line
per epoch (and one at the first step) for bench/run.py to read.

    accelerate launch -m bench.baseline --job JOB.json
    accelerate launch -m bench.baseline --job JOB.json --data memory   # the ceiling

`--recipe tutorial` is the tutorial's own recipe for the quality benchmark (SGD lr 0.01,
momentum 0.9, Resize + ToTensor + Normalize, no augmentation) instead of mirroring our spec's
optimizer and augmentation. The weights are saved as safetensors, `model.safetensors`.

`--data memory` runs the same loop on random tensors already in memory, as many as the split
holds: what training costs when images cost nothing to load, the most any input pipeline
can reach on this machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from PIL import Image
from safetensors.torch import save_model
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchvision import transforms

from training.data.split import read_manifest
from training.handoff import TrainJob
from training.models.build import build_model, input_channels, normalization


class ManifestImages(Dataset):
    def __init__(self, root: Path, rows, classes, transform):
        self.root, self.rows, self.transform = root, rows, transform
        self.index = {c: i for i, c in enumerate(classes)}

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, label, _ = self.rows[i]
        image = Image.open(self.root / path).convert(self.mode)
        return self.transform(image), self.index[label]


def make_datasets(job: TrainJob, augment: str | None = None) -> tuple[Dataset, Dataset]:
    """The tutorial's train and val datasets: PIL open + transforms on every access."""
    spec = job.training
    summary = job.split
    rows = read_manifest(job.manifest)
    channels = input_channels(spec.model, summary.channels)
    mean, std = normalization(spec.model, spec.pretrained, channels)
    augment = spec.augment if augment is None else augment
    size = spec.image_size
    steps = ([transforms.RandomResizedCrop(size, scale=(spec.crop_min_scale, 1.0))] if augment != "none"
             else [transforms.Resize((size, size))])
    steps += [transforms.RandomHorizontalFlip()] if augment == "crop_flip" else []
    train_tf = transforms.Compose(steps + [transforms.ToTensor(), transforms.Normalize(mean, std)])
    val_tf = transforms.Compose([transforms.Resize((size, size)), transforms.ToTensor(),
                                 transforms.Normalize(mean, std)])
    train_set = ManifestImages(summary.root, [r for r in rows if r[2] == "train"],
                               summary.class_names, train_tf)
    val_set = ManifestImages(summary.root, [r for r in rows if r[2] == "val"],
                             summary.class_names, val_tf)
    train_set.mode = val_set.mode = "L" if channels == 1 else "RGB"
    return train_set, val_set


def in_memory(like: Dataset, channels: int, size: int, classes: int) -> Dataset:
    """Random images already in memory, as many as `like` holds."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(len(like), channels, size, size, generator=generator)
    return TensorDataset(images, torch.randint(0, classes, (len(like),), generator=generator))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--data", choices=["files", "memory"], default="files")
    parser.add_argument("--recipe", choices=["mirror", "tutorial"], default="mirror")
    args = parser.parse_args()
    job = TrainJob.load(args.job)
    spec = job.training
    accelerator = Accelerator()
    set_seed(spec.seed)
    tutorial = args.recipe == "tutorial"
    summary = job.split
    channels = input_channels(spec.model, summary.channels)
    size = spec.image_size
    train_set, val_set = make_datasets(job, "none" if tutorial else None)
    if args.data == "memory":
        classes = len(summary.class_names)
        train_set = in_memory(train_set, channels, size, classes)
        val_set = in_memory(val_set, channels, size, classes)
    train_loader = DataLoader(train_set, batch_size=spec.batch_size, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=spec.batch_size)
    model = build_model(spec.model, len(summary.class_names), channels, size)
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if tutorial
                 else torch.optim.Adam(model.parameters(), lr=spec.lr))
    model, optimizer, train_loader, val_loader = accelerator.prepare(
        model, optimizer, train_loader, val_loader)
    first_step = None
    for epoch in range(1, spec.epochs + 1):
        started = time.perf_counter()
        model.train()
        seen = 0
        for images, labels in train_loader:
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            seen += len(labels) * accelerator.num_processes
            if first_step is None:
                first_step = time.time()
                if accelerator.is_main_process:
                    print(json.dumps({"event": "first_step", "time": first_step}), flush=True)
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for images, labels in val_loader:
                preds, labels = accelerator.gather((model(images).argmax(1), labels))
                correct += (preds == labels).sum().item()
                total += len(labels)
        seconds = time.perf_counter() - started
        if accelerator.is_main_process:
            print(json.dumps({"event": "epoch", "epoch": epoch, "epoch_seconds": seconds,
                              "images_per_second": seen / seconds,
                              "val_accuracy": correct / total}), flush=True)
    if accelerator.is_main_process:
        save_model(accelerator.unwrap_model(model), str(job.output_dir / "model.safetensors"))
    accelerator.end_training()  # the process group too: gloo can abort at exit without it


if __name__ == "__main__":
    main()
