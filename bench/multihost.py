"""Launch to first training step: one machine against two (network namespaces, as root).

    sudo .venv/bin/python -m bench.multihost --pairs 3

One machine: the train task's plain `accelerate launch` here. Two machines: the same call with
`num_machines: 2`, which starts a train-node flow run on each namespace's Prefect worker,
waits for machine 0's address and joins the ranks by c10d (tests/hosts.py builds the hosts).
Digits at 12 px, 2 processes per machine, one epoch; runs alternate in one invocation.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path


def first_step_s(output_dir: Path, started: float) -> float:
    from training.engine.progress import ProgressReader

    steps = [e.time for e in ProgressReader(output_dir).poll()
             if e.event == "heartbeat" and getattr(e, "phase", None) == "train"]
    return min(steps) - started


def breakdown(output_dir: Path, started: float) -> str:
    """Where the two-machine start-up goes: node flow runs running, ranks up, first step."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStartTime

    from training.engine.progress import ProgressReader

    events = ProgressReader(output_dir).poll()
    ranks_up = max(e.time for e in events if e.event == "start") - started
    with get_client(sync_client=True) as client:
        since = FlowRunFilterStartTime(after_=_utc(started))
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(start_time=since))
    running = max(r.start_time.timestamp() for r in runs if r.name) - started
    return f"node runs running {running:.1f} s, all ranks up {ranks_up:.1f} s"


def _utc(timestamp: float):
    from datetime import UTC, datetime

    return datetime.fromtimestamp(timestamp, UTC)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="trainflow-bench-multihost-"))
    home = folder / "home"
    os.environ.update(TRAINFLOW_HOME=str(home), PREFECT_HOME=str(folder / "client"),
                      DO_NOT_TRACK="1")
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.train import run_training
    from tests.hosts import two_hosts
    from training.config import DatasetSpec, SplitSpec, TrainingSpec
    from training.data.sources import prepare
    from training.data.split import split_dataset
    from training.handoff import TrainJob

    logger = logging.getLogger("bench.multihost")
    split = split_dataset(prepare(DatasetSpec(source="builtin:digits"), home), SplitSpec(), home)
    times: dict[int, list[float]] = {1: [], 2: []}
    with two_hosts(folder, {"TRAINFLOW_HOME": str(home)}) as hosts, \
            temporary_settings({PREFECT_API_URL: hosts.api}):
        for pair in range(args.pairs):
            for machines in (1, 2):
                spec = TrainingSpec(epochs=1, image_size=12, batch_size=32, num_processes=2,
                                    num_machines=machines, heartbeat_steps=1)
                job = TrainJob(split=split, training=spec,
                               output_dir=home / "runs" / f"{pair}-{machines}")
                started = time.time()
                result = run_training(job, logger, resume=False)
                times[machines].append(first_step_s(job.output_dir, started))
                where = breakdown(job.output_dir, started) if machines > 1 else ""
                print(f"pair {pair + 1}: {machines} machine(s), world {result.world_size}: "
                      f"first step after {times[machines][-1]:.1f} s {where}", flush=True)
    one, two = statistics.median(times[1]), statistics.median(times[2])
    print(f"\n| machines | world size | launch to first step, median s (runs) |\n|---|---|---|\n"
          f"| 1 | 2 | {one:.1f} ({', '.join(f'{t:.1f}' for t in times[1])}) |\n"
          f"| 2 | 4 | {two:.1f} ({', '.join(f'{t:.1f}' for t in times[2])}) |\n"
          f"\n2 machines / 1 machine: {two / one:.2f}x")


if __name__ == "__main__":
    main()
