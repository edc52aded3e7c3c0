"""Flagship scale: a dogs-vs-cats-sized set of generated photos through the data stages, and
(with --train) the whole flow against the tutorial-style script, and the flow's own launch
alone beside them (what the flow adds around its launch).

    python -m bench.scale --images 25000 --pairs 2            # data stages only
    python -m bench.scale --images 25000 --pairs 1 --train    # (make bench-scale)

The photos (bench/make_photos.py, 256-500 px JPEGs, two classes) are generated once into
~/.cache/trainflow-bench/ and reused. Runs alternate within one invocation; medians.

Data stages, each from a fresh home: one full decode of every image on all cores (the
yardstick); the split that only checks followed by the training's decode (two passes, as
before); the split that decodes each image once at its training side, followed by the
training's decode (which then finds everything decoded).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from PIL import Image

CACHE = Path.home() / ".cache" / "trainflow-bench"
SIZE = 64


def photos(images: int) -> Path:
    from bench.make_photos import make

    folder = CACHE / f"photos-{images}"
    if not (folder / ".complete").exists():
        shutil.rmtree(folder, ignore_errors=True)
        started = time.perf_counter()
        make(folder / "train", images // 2)
        (folder / ".complete").write_text(f"{time.perf_counter() - started:.0f} s to make\n")
    return folder / "train"


def on_all_cores(work, items) -> float:
    """Seconds to run `work` on every item with a process per core (threads are GIL-bound on
    PIL's header parsing); `work` returns nothing, so no decoded image is kept."""
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(work, items, chunksize=64))
    return time.perf_counter() - started


def full_decode(path: Path) -> None:
    with Image.open(path) as img:
        img.load()


def data_stages(root: Path, pairs: int) -> list[str]:
    from training.config import DatasetSpec, SplitSpec, TrainingSpec
    from training.data.cache import decode_split
    from training.data.sides import split_sides
    from training.data.sources import prepare
    from training.data.split import split_dataset
    from training.data.store import store_bytes

    files = sorted(root.iterdir())
    sides = split_sides(TrainingSpec(model="resnet18", image_size=SIZE, augment="crop_flip"))
    times: dict[str, list[float]] = {k: [] for k in ("full", "check", "caches", "once", "after")}
    disk = 0
    for _ in range(pairs):
        times["full"].append(on_all_cores(full_decode, files))
        for way in ("before", "now"):
            home = Path(tempfile.mkdtemp(prefix="trainflow-bench-scale-"))
            try:
                ref = prepare(DatasetSpec(source=str(root.parent), labels="filename",
                                          subdir="train"), home)
                started = time.perf_counter()
                split = split_dataset(ref, SplitSpec(val_fraction=0.2, test_fraction=0.1), home,
                                      sides if way == "now" else None)
                times["once" if way == "now" else "check"].append(time.perf_counter() - started)
                started = time.perf_counter()
                for name, side in sides.items():  # what the training launch decodes
                    decode_split(split, name, side, 3)
                times["after" if way == "now" else "caches"].append(time.perf_counter() - started)
                disk = store_bytes(split.manifest.parent.parent)
            finally:
                shutil.rmtree(home, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    runs = {k: ", ".join(f"{t:.1f}" for t in v) for k, v in times.items()}
    now, before = med["once"] + med["after"], med["check"] + med["caches"]
    peak_mb = max(resource.getrusage(who).ru_maxrss for who in
                  (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024
    rows = {"full": "one full decode of every image, a process per core (yardstick)",
            "check": "before: split, checking at 1/8 JPEG scale",
            "caches": f"before: then the training decodes train, val, test ({sides})",
            "once": "now: split, the check decoding each image at its training side",
            "after": "now: then the training's decode (finds every image decoded)"}
    return [
        f"{len(files)} JPEGs, {os.cpu_count()} cores, medians of {pairs} (runs)", "",
        "| stage | s |", "|---|---|",
        *(f"| {label} | {med[key]:.1f} ({runs[key]}) |" for key, label in rows.items()),
        "", f"- split + caches: now {now:.1f} s = **{now / med['full']:.2f}x** one full decode "
        f"(before {before:.1f} s = {before / med['full']:.2f}x); target 1.2x",
        f"- decoded images on disk: {disk / 1e6:.0f} MB; peak resident memory of one "
        f"process {peak_mb:.0f} MB"]


def bare_launch(job, folder: Path) -> float:
    """Wall seconds of what the flow's train task launches, alone: the training and the test
    split's predictions in the same processes (`--evaluate-into`)."""
    import subprocess

    from runtime.launcher import launch_command, launch_env

    folder.mkdir(parents=True, exist_ok=True)
    job = job.model_copy(update={"output_dir": folder})
    command = launch_command(job.training, "training.train",
                             ["--job", str(job.save()), "--evaluate-into", str(folder / "ev")])
    started = time.perf_counter()
    done = subprocess.run(command, env=launch_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"our launch failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return time.perf_counter() - started


def train_side_by_side(root: Path, pairs: int, epochs: int) -> list[str]:
    """The whole flow (prepare -> register), the launch it makes alone, and the tutorial-style
    script, alternated."""
    from prefect.testing.utilities import prefect_test_harness

    from bench.run import launch
    from flows.train_flow import train_flow
    from training.config import DatasetSpec, SplitSpec
    from training.data.sources import prepare
    from training.data.split import split_dataset
    from training.handoff import TrainJob

    training = {"model": "resnet18", "image_size": SIZE, "batch_size": 64, "epochs": epochs,
                "num_processes": 2}
    dataset = {"source": str(root.parent), "labels": "filename", "subdir": "train"}
    walls: dict[str, list[float]] = {"flow": [], "train task": [], "launch": [], "baseline": []}
    home = Path(tempfile.mkdtemp(prefix="trainflow-bench-scale-"))
    os.environ["TRAINFLOW_HOME"] = str(home)
    try:
        with prefect_test_harness(server_startup_timeout=120):
            for pair in range(pairs):
                for cold in ("datasets", "splits"):  # every flow prepares, checks and decodes
                    shutil.rmtree(home / cold, ignore_errors=True)
                started = time.perf_counter()
                state = train_flow(dataset=dataset, training=training, force=True,
                                   split={"val_fraction": 0.2, "test_fraction": 0.1},
                                   registry={"model_name": "scale"}, return_state=True)
                walls["flow"].append(time.perf_counter() - started)
                walls["train task"].append(task_seconds(state)["train"])
                split = split_dataset(prepare(DatasetSpec(**dataset), home),
                                      SplitSpec(val_fraction=0.2, test_fraction=0.1), home)
                job = TrainJob(split=split, training=training, output_dir=home / f"b{pair}")
                walls["baseline"].append(launch("baseline", job, 2, home / f"b{pair}")["wall"])
                walls["launch"].append(bare_launch(job, home / f"l{pair}"))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    f, t, n, b = (statistics.median(walls[k]) for k in ("flow", "train task", "launch", "baseline"))

    def runs(key: str) -> str:
        return ", ".join(f"{t:.1f}" for t in walls[key])

    return ["", f"resnet18 {SIZE} px, {epochs} epochs, 2 processes, medians of {pairs}", "",
            "| run | wall s (runs) |", "|---|---|",
            f"| whole flow: prepare, split, train, evaluate, register | {f:.1f} ({runs('flow')}) |",
            f"| of which its train task (the launch, streamed and logged) | {t:.1f} "
            f"({runs('train task')}) |",
            f"| the flow's launch alone: train, then predict the test split | {n:.1f} "
            f"({runs('launch')}) |",
            f"| tutorial-style script: train only (data already split) | {b:.1f} "
            f"({runs('baseline')}) |",
            "", f"- flow / script: **{f / b:.2f}x**; the launch alone / script: {n / b:.2f}x; "
            f"the flow around its launch: {f - n:.1f} s, of which outside its train task "
            f"{f - t:.1f} s"]


def task_runs(state) -> list:
    """The task runs of one flow run, as Prefect recorded them, in the order they started."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        only_it = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        return sorted(client.read_task_runs(flow_run_filter=only_it), key=lambda t: t.start_time)


def task_seconds(state) -> dict[str, float]:
    """Each task run's seconds in one flow run, by task name."""
    # Run names end in a suffix: "split_dataset-0c2", "train-resnet18".
    return {t.name.rsplit("-", 1)[0]: t.total_run_time.total_seconds() for t in task_runs(state)}


def stage_profile(root: Path, epochs: int) -> list[str]:
    """One whole flow, cold data: how long each of its task runs took (Prefect's own record)."""
    from prefect.testing.utilities import prefect_test_harness

    from flows.train_flow import train_flow

    training = {"model": "resnet18", "image_size": SIZE, "batch_size": 64, "epochs": epochs,
                "num_processes": 2}
    home = Path(tempfile.mkdtemp(prefix="trainflow-bench-scale-"))
    os.environ["TRAINFLOW_HOME"] = str(home)
    try:
        with prefect_test_harness(server_startup_timeout=120):
            started = time.perf_counter()
            state = train_flow(dataset={"source": str(root.parent), "labels": "filename",
                                        "subdir": "train"},
                               split={"val_fraction": 0.2, "test_fraction": 0.1},
                               training=training, registry={"model_name": "profile"},
                               return_state=True)
            wall = time.perf_counter() - started
            tasks = task_runs(state)
            history = state.result().trained.history
    finally:
        shutil.rmtree(home, ignore_errors=True)
    total = sum(t.total_run_time.total_seconds() for t in tasks)
    epochs_s = sum(e.epoch_seconds for e in history)
    return ["", f"one whole flow, resnet18 {SIZE} px, {epochs} epochs, 2 processes: "
            f"{wall:.0f} s wall", "", "| task run | s |", "|---|---|",
            *(f"| {t.name.rsplit('-', 1)[0]} | {t.total_run_time.total_seconds():.1f} |"
              for t in tasks),
            f"| (all task runs) | {total:.1f} |",
            f"| of which the training epochs themselves (train + validation, rank 0) "
            f"| {epochs_s:.1f} |",
            f"| outside any task run (engine, parameters, results) | {wall - total:.1f} |"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=25000)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--profile", action="store_true",
                        help="instead: one whole flow, each task run's time")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    root = photos(args.images)
    if args.profile:
        print("\n".join(stage_profile(root, args.epochs)))
        return
    lines = data_stages(root, args.pairs)
    print("\n".join(lines), flush=True)
    if args.train:
        print("\n".join(train_side_by_side(root, args.pairs, args.epochs)))


if __name__ == "__main__":
    main()
