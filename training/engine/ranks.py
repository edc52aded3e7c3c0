"""One rank's life under `accelerate launch`, the same for training, evaluation and scoring.

    with run_ranks(out) as (accelerator, rank, progress):
        ...   # the entry point's own work

Tied to its launcher (a hard-killed launch takes its ranks down), its Accelerator made once,
the `start` event that tells the launcher the rank is up, an exception reported on the rank's
channel (with its traceback, once), and the process group torn down at the end. A rank that
leaves early on purpose (`SystemExit(0)`: saved for a preemption) tears down too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from accelerate import Accelerator

from training.engine.progress import ProgressWriter, Rank, start_rank
from training.processes import MACHINE_RANK, die_with_parent


def ranks_in_machine_order() -> None:
    """Global ranks numbered machine by machine: machine m's ranks are m * per_machine + local.

    torchrun's c10d rendezvous numbers the machines in the order of their host names and
    process ids, not by --machine_rank, so global rank 0 (which writes the best weights and
    reports the result) could be on any machine. Machine 0's launch is the one whose events the
    train task reads; with no shared folder it must hold rank 0. Every rank renumbers itself
    before the process group forms: a permutation all agree on (each machine's rank is unique),
    and the group's store is the launchers' own, so no rank has to host it.
    """
    machine = os.environ.get(MACHINE_RANK)
    if machine is None or "LOCAL_RANK" not in os.environ:
        return
    per_machine = int(os.environ["LOCAL_WORLD_SIZE"])
    os.environ["RANK"] = str(int(machine) * per_machine + int(os.environ["LOCAL_RANK"]))
    os.environ["GROUP_RANK"] = machine


@contextlib.contextmanager
def run_ranks(output_dir: Path, make_accelerator: Callable[[], Accelerator] = Accelerator
              ) -> Iterator[tuple[Accelerator, Rank, ProgressWriter]]:
    die_with_parent()
    ranks_in_machine_order()
    accelerator = make_accelerator()
    rank, progress = start_rank(accelerator, output_dir)
    try:
        with progress.reporting_errors():
            yield accelerator, rank, progress
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    accelerator.end_training()  # trackers, and the process group
