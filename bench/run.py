"""Benchmarks, in one invocation, as alternating A/B pairs; prints a table of medians and ratios.

    .venv/bin/python -m bench.run                 # (make bench) the full table, ~10 min here
    .venv/bin/python -m bench.run --pairs 1 --per-class 40 --epochs 2 --skip-flow   # smoke

- the input pipeline alone (no model): images/s of our decode-once loader vs the tutorial's
  per-access PIL decoding;
- training throughput and epoch time, epoch 1 and epochs 2+, ours vs the tutorial-style
  baseline (bench/baseline.py) and vs the ceiling (the baseline's loop on in-memory tensors),
  1 and 2 processes, resnet18 on generated JPEGs at 64 px and basicnet on digits at 28 px;
- peak resident memory of the training processes (sampled);
- `accelerate launch` start-up: launch to the first training step;
- the whole flow (prepare -> register, data present) against the bare launch of the same job.
Devices are chosen by Accelerate, so the same script fills the table on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

from bench.make_photos import make as make_photos
from runtime.launcher import launch_command, launch_env
from training.config import DatasetSpec, SplitSpec
from training.data.sources import prepare
from training.data.split import split_dataset
from training.engine.progress import ProgressReader
from training.handoff import TrainJob

# What each implementation launches: module and extra arguments.
IMPLS = {"ours": ("training.train", []), "baseline": ("bench.baseline", []),
         "ceiling": ("bench.baseline", ["--data", "memory"])}
MODULES = {module for module, _ in IMPLS.values()}


def sample_rss(root: psutil.Process, stop: threading.Event, peaks: dict) -> None:
    while not stop.is_set():
        try:
            ranks = [p for p in root.children(recursive=True)
                     if any(m in " ".join(p.cmdline()) for m in MODULES)]
            rss = [p.memory_info().rss for p in ranks]
        except psutil.Error:
            rss = []
        if rss:
            peaks["rank"] = max(peaks.get("rank", 0), max(rss))
            peaks["total"] = max(peaks.get("total", 0), sum(rss))
        time.sleep(0.2)


def launch(kind: str, job: TrainJob, processes: int, folder: Path, cold: bool = True) -> dict:
    """One launch of ours or the baseline; wall, start-up, per-epoch figures and peak RSS."""
    spec = job.training.model_copy(update={"num_processes": processes, "heartbeat_steps": 1})
    job = job.model_copy(update={"training": spec, "output_dir": folder})
    if kind == "ours" and cold:  # epoch-1 figures and wall time include decoding
        shutil.rmtree(job.manifest.parent / "cache", ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    module, extra = IMPLS[kind]
    command = launch_command(spec, module, ["--job", str(job.save()), *extra])
    started = time.time()
    proc = subprocess.Popen(command, env=launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    peaks, stop = {}, threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(psutil.Process(proc.pid), stop, peaks))
    sampler.start()
    output, _ = proc.communicate()
    wall = time.time() - started
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{output[-3000:]}")
    if kind == "ours":
        events = ProgressReader(folder).poll()
        first = min(e.time for e in events if e.event == "heartbeat" and e.phase == "train")
        epochs = [e.metrics for e in events if e.event == "epoch" and e.rank == 0]
    else:
        lines = [json.loads(x) for x in output.splitlines() if x.startswith('{"event"')]
        first = next(x["time"] for x in lines if x["event"] == "first_step")
        epochs = [SimpleNamespace(**x) for x in lines if x["event"] == "epoch"]
    return {"wall": wall, "startup": first - started, "peak_rank_mb": peaks.get("rank", 0) / 2**20,
            "peak_total_mb": peaks.get("total", 0) / 2**20,
            "epoch1_ips": epochs[0].images_per_second,
            "later_ips": _median_or_nan([e.images_per_second for e in epochs[1:]]),
            "epoch1_s": epochs[0].epoch_seconds,
            "later_s": _median_or_nan([e.epoch_seconds for e in epochs[1:]])}


def _median_or_nan(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def datasets(home: Path, per_class: int) -> dict[str, Path]:
    photos = make_photos(home / "photos", per_class)
    splits = {}
    for name, spec in {"digits": DatasetSpec(source="builtin:digits"),
                       "jpeg": DatasetSpec(source=str(photos), labels="filename")}.items():
        splits[name] = split_dataset(prepare(spec, home), SplitSpec(), home)
    return splits


def loader_table(splits, home: Path, epochs: int) -> list[str]:
    """The input pipeline alone (no model): images/s our loader and the tutorial's deliver."""
    from torch.utils.data import DataLoader

    from bench.baseline import make_datasets
    from training.data.cache import CachedImages, decode_split
    from training.data.sides import cache_side

    job = TrainJob(split=splits["jpeg"], output_dir=home / "loader",
                   training={"model": "resnet18", "image_size": 64, "batch_size": 32})
    shutil.rmtree(job.manifest.parent.parent / "decoded", ignore_errors=True)

    def ours():
        from bench.gpu import Augmented
        from training.data.augment import augmentation

        return Augmented(CachedImages(decode_split(job.split, "train", cache_side(64, True), 3)),
                         augmentation(job.training.model_copy(update={"augment": "crop_flip"})))

    lines = ["| input pipeline, jpeg 64px, batch 32, 1 process | epoch 1 img/s | epochs 2+ img/s |",
             "|---|---|---|"]
    rates = {}
    for name, make in (("ours (decode once, cached uint8)", ours),
                       ("baseline (PIL decode every access)", lambda: make_datasets(job)[0])):
        seconds = []
        started = time.perf_counter()
        dataset = make()  # ours decodes here, once: epoch 1 pays for it
        for _ in range(epochs):
            for _ in DataLoader(dataset, batch_size=32, shuffle=True):
                pass
            seconds.append(time.perf_counter() - started)
            started = time.perf_counter()
        rates[name] = (len(dataset) / seconds[0],
                       statistics.median(len(dataset) / s for s in seconds[1:]))
        lines.append(f"| {name} | {rates[name][0]:.0f} | {rates[name][1]:.0f} |")
    (o1, o2), (b1, b2) = rates.values()
    return lines + ["", f"- input pipeline alone, ours/baseline: epoch 1 {o1 / b1:.1f}x, "
                        f"epochs 2+ {o2 / b2:.1f}x"]


# The training table's cases: (dataset, training fields).
SETTINGS = {"jpeg 64px resnet18": ("jpeg", {"model": "resnet18", "image_size": 64, "batch_size": 32}),
            "digits 28px basicnet": ("digits", {"model": "basicnet", "image_size": 28,
                                                "batch_size": 64})}


def throughput_table(splits, home: Path, pairs: int, epochs: int,
                     processes: tuple[int, ...] = (1, 2),
                     data_names: tuple[str, ...] = ("jpeg", "digits")) -> list[str]:
    settings = {name: setting for name, setting in SETTINGS.items() if setting[0] in data_names}
    lines = ["| setting | procs | impl | epoch 1 img/s | epochs 2+ img/s | epochs 2+ s/epoch "
             "| start-up s | peak RSS/rank MB | peak RSS total MB |", "|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for name, (data, training) in settings.items():
        for procs in processes:
            runs = {kind: [] for kind in IMPLS}
            job = TrainJob(split=splits[data], output_dir=home / "x",
                           training={**training, "epochs": epochs})
            for pair in range(pairs):
                order = list(IMPLS)[pair % 3:] + list(IMPLS)[:pair % 3]  # each goes first once
                for kind in order:
                    runs[kind].append(launch(kind, job, procs, home / f"{kind}-{name}-{procs}-{pair}"))
            med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
            for kind, m in med.items():
                lines.append(f"| {name} | {procs} | {kind} | {m['epoch1_ips']:.0f} | "
                             f"{m['later_ips']:.0f} | {m['later_s']:.2f} | {m['startup']:.1f} | "
                             f"{m['peak_rank_mb']:.0f} | {m['peak_total_mb']:.0f} |")
            later = {k: m["later_ips"] for k, m in med.items()}
            ratios.append(f"- {name}, {procs} process(es): ours/baseline images/s, epoch 1 "
                          f"{med['ours']['epoch1_ips'] / med['baseline']['epoch1_ips']:.2f}x, "
                          f"epochs 2+ {later['ours'] / later['baseline']:.2f}x; ceiling/baseline "
                          f"{later['ceiling'] / later['baseline']:.2f}x (the most any input "
                          f"pipeline can gain here); ours at {later['ours'] / later['ceiling']:.0%} "
                          "of the ceiling")
    return lines + [""] + ratios


def flow_overhead(splits, home: Path, pairs: int) -> list[str]:
    """Flow (prepare -> register) wall time vs the bare launch of the same training job.

    Also the median time of each stage (from the Prefect API) and of an empty flow (Prefect's
    own cost per flow run), so that the difference can be attributed.
    """
    os.environ["TRAINFLOW_HOME"] = str(home)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.testing.utilities import prefect_test_harness

    from flows.train_flow import train_flow

    @flow
    def empty() -> None:
        pass

    training = {"model": "basicnet", "image_size": 28, "batch_size": 64, "epochs": 3,
                "num_processes": 2, "heartbeat_steps": 1}  # the bare launch's reporting too
    job = TrainJob(split=splits["digits"], output_dir=home / "x", training=training)
    walls: dict[str, list[float]] = {"flow": [], "bare": [], "empty": []}
    run_ids = []
    with prefect_test_harness(server_startup_timeout=120):
        train_flow(dataset={"source": "builtin:digits"}, training=training, force=True,
                   registry={"model_name": "bench-warmup"})  # imports and server warm
        for pair in range(pairs):
            started = time.time()
            state = train_flow(dataset={"source": "builtin:digits"}, training=training,
                               force=True, registry={"model_name": "bench"}, return_state=True)
            walls["flow"].append(time.time() - started)
            run_ids.append(state.state_details.flow_run_id)
            # Warm decode cache for both, as in a scheduled retrain on unchanged data.
            walls["bare"].append(launch("ours", job, 2, home / f"bare-{pair}", cold=False)["wall"])
            started = time.time()
            empty()
            walls["empty"].append(time.time() - started)
        with get_client(sync_client=True) as client:
            task_runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=run_ids)))
    stages: dict[str, list[float]] = {}
    for run in task_runs:
        name = run.name.rsplit("-", 1)[0]  # "evaluate_model-3f2" -> "evaluate_model"
        stages.setdefault(name, []).append((run.end_time - run.start_time).total_seconds())
    f, b, e = (statistics.median(walls[k]) for k in ("flow", "bare", "empty"))
    lines = ["| digits 28px basicnet, 3 epochs, 2 procs | wall s |", "|---|---|",
             f"| whole flow (preflight -> register) | {f:.2f} |",
             f"| bare accelerate launch | {b:.2f} |",
             f"| an empty Prefect flow (the engine's own cost) | {e:.2f} |"]
    lines += [f"| stage {name} | {statistics.median(times):.2f} |"
              for name, times in sorted(stages.items(), key=lambda kv: -max(kv[1]))]
    return lines + ["", f"- flow / bare launch: {f / b:.2f}x (medians of {pairs})"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--per-class", type=int, default=500)
    parser.add_argument("--skip-flow", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2],
                        help="process counts of the training table (default: 1 2)")
    parser.add_argument("--datasets", nargs="+", choices=["jpeg", "digits"],
                        default=["jpeg", "digits"],
                        help="the training table's datasets (default: both)")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    home = Path(tempfile.mkdtemp(prefix="trainflow-bench-"))
    started = time.time()
    try:
        splits = datasets(home, args.per_class)
        lines = [f"machine: {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
                 f"{args.pairs} alternating pairs, {args.epochs} epochs, "
                 f"{2 * args.per_class} generated JPEGs", ""]
        if not args.skip_throughput:
            lines += loader_table(splits, home, args.epochs) + [""]
            lines += throughput_table(splits, home, args.pairs, args.epochs,
                                      tuple(args.processes), tuple(args.datasets))
        if not args.skip_flow:
            lines += [""] + flow_overhead(splits, home, args.pairs)
        lines += ["", f"bench wall time: {time.time() - started:.0f} s"]
        print("\n".join(lines))
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
