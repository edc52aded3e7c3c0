"""train-node: one machine's part of a training on several machines.

Started by train-flow's train task (training.num_machines > 1), once per machine, through the
`train-node/nodes` deployment; each run goes to the work queue of its machine. Not meant to be
run by hand.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from runtime.infrastructure import end_with_worker
from tasks.nodes import launch_node


@flow(name="train-node")
def train_node(job_file: Path, machine_rank: int, resume: bool = True,
               machine_0_run: str | None = None) -> int:
    """`machine_0_run`: the flow run of machine 0, where machines 1.. read its address."""
    end_with_worker()  # runtime/infrastructure.py: a worker's flow runs end with it
    return launch_node(job_file, machine_rank, resume, machine_0_run)
