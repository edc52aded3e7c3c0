"""Learning quality: held-out accuracy of ours against the tutorial script, equal epochs.

    python -m bench.quality --seeds 3 --epochs 8          # make bench-quality

Three generated photo-like sets (never committed), each with held-out images in neither split:
- digits-photo: scikit-learn's digits rendered as colour JPEGs (48-96 px, random colours,
  80-100% of the frame at a random offset, noise); a mirrored 2 or 7 is not a 2 or 7, so flips hurt.
- shapes: circles, squares, triangles and crosses on noisy backgrounds; mirror images are the
  same class, so flips are harmless.
- digits-imbalanced: digits-photo with classes kept at 100% down to 12% of their images.
For each set and seed: the tutorial script (bench/baseline.py --recipe tutorial: Resize,
ToTensor, Normalize, SGD 0.01 momentum 0.9), ours with its defaults, and ours with a recipe
(below). Every model is scored on the same held-out images; medians and ranges over seeds.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter
from safetensors.torch import load_model

from bench.baseline import make_datasets
from runtime.launcher import launch_command, launch_env
from tasks.train import run_training
from trainflow_serving.images import load_resized
from training.config import DatasetSpec, SplitSpec
from training.data.sources import prepare
from training.data.split import split_dataset
from training.handoff import TrainJob
from training.models.build import build_model, load_trained

LOG = logging.getLogger("bench-quality")
COMMON = {"model": "resnet18", "image_size": 32, "batch_size": 32, "num_processes": 2}
RECIPE = {"lr": 0.003, "lr_schedule": "onecycle"}
HELD_OUT_PER_CLASS = 15


def colours(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...]]:
    while True:
        fg = tuple(rng.randrange(256) for _ in range(3))
        bg = tuple(rng.randrange(256) for _ in range(3))
        if sum(abs(a - b) for a, b in zip(fg, bg, strict=True)) > 200:
            return fg, bg


def compose(mask: Image.Image, side: int, rng: random.Random) -> Image.Image:
    """A grayscale mask painted in random colours onto a noisy background, as a photo."""
    fg, bg = colours(rng)
    scale = rng.uniform(0.8, 1.0)
    inner = max(8, int(side * scale))
    m = np.zeros((side, side), np.float32)
    x, y = rng.randrange(side - inner + 1), rng.randrange(side - inner + 1)
    m[y:y + inner, x:x + inner] = np.asarray(mask.resize((inner, inner), Image.BILINEAR),
                                             np.float32) / 255
    noise = np.random.default_rng(rng.randrange(2**32)).normal(0, 12, (side, side, 3))
    pixels = (np.array(bg) * (1 - m[..., None]) + np.array(fg) * m[..., None] + noise)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).filter(
        ImageFilter.GaussianBlur(rng.uniform(0, 0.8)))


def digits_photo(folder: Path, held_out: Path, keep: list[float] | None = None) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = random.Random(0)
    seen = {c: 0 for c in range(10)}
    for i, (image, target) in enumerate(zip(digits.images, digits.target, strict=True)):
        mask = Image.fromarray(np.clip(image * 16, 0, 255).astype(np.uint8))
        photo = compose(mask, rng.randint(48, 96), random.Random(i))
        target = int(target)
        if seen[target] < HELD_OUT_PER_CLASS:
            seen[target] += 1
            out = held_out / str(target)
        elif keep is None or rng.random() < keep[target]:
            out = folder / str(target)
        else:
            continue
        out.mkdir(parents=True, exist_ok=True)
        photo.save(out / f"d{i:04d}.jpg", "JPEG", quality=85)


def shapes(folder: Path, held_out: Path, per_class: int = 400) -> None:
    for label in ("circle", "square", "triangle", "cross"):
        for i in range(per_class + HELD_OUT_PER_CLASS):
            rng = random.Random(f"{label}:{i}")
            mask = Image.new("L", (64, 64), 0)
            draw = ImageDraw.Draw(mask)
            if label == "circle":
                draw.ellipse([4, 4, 60, 60], fill=255)
            elif label == "square":
                draw.rectangle([8, 8, 56, 56], fill=255)
            elif label == "triangle":
                draw.polygon([(32, 4), (60, 60), (4, 60)], fill=255)
            else:
                draw.rectangle([26, 4, 38, 60], fill=255)
                draw.rectangle([4, 26, 60, 38], fill=255)
            mask = mask.rotate(rng.uniform(-25, 25), resample=Image.BILINEAR)
            out = (held_out if i < HELD_OUT_PER_CLASS else folder) / label
            out.mkdir(parents=True, exist_ok=True)
            compose(mask, rng.randint(48, 96), rng).save(out / f"{label}.{i}.jpg", "JPEG",
                                                         quality=85)


def held_out_images(folder: Path, classes: list[str]) -> list[tuple[Path, int]]:
    return [(p, classes.index(p.parent.name)) for p in sorted(folder.glob("*/*.jpg"))]


@torch.no_grad()
def accuracy(model: torch.nn.Module, batch: torch.Tensor, labels: list[int]) -> float:
    predicted = model.eval()(batch).argmax(1)
    return float((predicted == torch.tensor(labels)).float().mean())


def score_ours(job: TrainJob, weights: Path, images: list[tuple[Path, int]]) -> float:
    model = load_trained(job, weights)
    from training.models.build import preprocessing_for

    pre = preprocessing_for(job)
    batch = torch.from_numpy(np.stack([load_resized(p, pre.image_size, pre.channels)
                                       for p, _ in images])).float()
    mean = torch.tensor(pre.mean).view(1, -1, 1, 1) * 255
    std = torch.tensor(pre.std).view(1, -1, 1, 1) * 255
    return accuracy(model, (batch - mean) / std, [label for _, label in images])


def score_baseline(job: TrainJob, weights: Path, images: list[tuple[Path, int]]) -> float:
    """With the tutorial's own validation transform (PIL Resize, ToTensor, Normalize)."""
    _, val_set = make_datasets(job, "none")
    model = build_model("resnet18", len(job.split.class_names), 3, job.training.image_size)
    load_model(model, str(weights), strict=True)
    batch = torch.stack([val_set.transform(Image.open(p).convert("RGB")) for p, _ in images])
    return accuracy(model, batch, [label for _, label in images])


def run_baseline(job: TrainJob) -> Path:
    job.output_dir.mkdir(parents=True, exist_ok=True)
    command = launch_command(job.training, "bench.baseline",
                             ["--job", str(job.save()), "--recipe", "tutorial"])
    done = subprocess.run(command, env=launch_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    return job.output_dir / "model.safetensors"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--sets", default="digits-photo,shapes,digits-imbalanced")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    home = Path(tempfile.mkdtemp(prefix="trainflow-bench-quality-"))
    os.environ["TRAINFLOW_HOME"] = str(home)
    makers = {"digits-photo": lambda f, h: digits_photo(f, h),
              "shapes": lambda f, h: shapes(f, h),
              "digits-imbalanced": lambda f, h: digits_photo(
                  f, h, keep=[1, 1, .6, .6, .35, .35, .2, .2, .12, .12])}
    started = time.time()
    lines = [f"{args.seeds} seeds, {args.epochs} epochs, resnet18 at 32 px, batch 32 per "
             f"process, 2 processes; held-out: {HELD_OUT_PER_CLASS} images per class in neither "
             f"split; recipe = {RECIPE}", "",
             "| set | train+val+test images | tutorial script | ours, defaults | ours, recipe |",
             "|---|---|---|---|---|"]
    try:
        for name in args.sets.split(","):
            folder, held = home / name / "data", home / name / "held-out"
            makers[name](folder, held)
            split = split_dataset(prepare(DatasetSpec(source=str(folder)), home), SplitSpec(),
                                  home)
            images = held_out_images(held, split.class_names)
            scores: dict[str, list[float]] = {"tutorial": [], "defaults": [], "recipe": []}
            for seed in range(args.seeds):
                for kind in scores:  # alternated within each seed
                    training = {**COMMON, "epochs": args.epochs, "seed": seed,
                                **(RECIPE if kind == "recipe" else {})}
                    job = TrainJob(split=split, output_dir=home / name / f"{kind}-{seed}",
                                   training=training)
                    if kind == "tutorial":
                        scores[kind].append(score_baseline(job, run_baseline(job), images))
                    else:
                        result = run_training(job, LOG, resume=False)
                        scores[kind].append(score_ours(job, result.weights, images))
            cells = [f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"
                     for v in scores.values()]
            total = sum(sum(c.values()) for c in split.counts.values())
            lines.append(f"| {name} | {total} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
        lines += ["", f"bench wall time: {time.time() - started:.0f} s"]
        print("\n".join(lines))
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
