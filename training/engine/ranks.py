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
from collections.abc import Callable, Iterator
from pathlib import Path

from accelerate import Accelerator

from training.engine.progress import ProgressWriter, Rank, start_rank
from training.processes import die_with_parent


@contextlib.contextmanager
def run_ranks(output_dir: Path, make_accelerator: Callable[[], Accelerator] = Accelerator
              ) -> Iterator[tuple[Accelerator, Rank, ProgressWriter]]:
    die_with_parent()
    accelerator = make_accelerator()
    rank, progress = start_rank(accelerator, output_dir)
    try:
        with progress.reporting_errors():
            yield accelerator, rank, progress
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    accelerator.end_training()  # trackers, and the process group
